"""`flashrec bench`: offline saturation benchmark of constrained beam search on a synthetic
workload, with the roofline floor and an HF transformers baseline measured in the same run."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from flashrec_core.bench.roofline import measure_peaks, wave_cost
from flashrec_core.bench.workload import (
    RequestSpec,
    load_shape,
    random_catalog,
    random_model,
    sid_layout_at_end,
    synthetic_requests,
)
from flashrec_core.config import EngineConfig
from flashrec_core.engine.beam_wave import BeamWave, WaveOutput
from flashrec_core.engine.model_runner import ModelRunner
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.engine.scheduler import plan_waves
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.trie import build_trie

logger = logging.getLogger("flashrec")


@dataclass(frozen=True)
class BenchConfig:
    preset: str | None = None
    config_path: str | None = None
    prompt_len: int = 1024
    shared_prefix: int = 64
    n: int = 50
    num_requests: int = 400
    catalog_size: int = 1_000_000
    level_sizes: tuple[int, ...] = (8192, 8192, 8192)
    fp8: bool = True
    cascade: bool = True
    graphs: bool = True
    beam_attention: str = "auto"
    prefill_attention: str = "auto"
    rows_per_wave: int = 8192
    hf_baseline: bool = True
    hf_requests: int = 8
    hf_batch: int = 4
    seed: int = 0
    profile_path: str | None = None
    """Write a torch.profiler table (CUDA and CPU time per op) of one extra wave here."""


def _build(bc: BenchConfig) -> tuple[BeamWave, Any, torch.Tensor]:
    shape = load_shape(bc.preset, bc.config_path)
    per_wave = bc.rows_per_wave // bc.n
    kv_tokens = per_wave * (bc.prompt_len + bc.n * len(bc.level_sizes)) + 1024
    cfg = EngineConfig(
        model_path="<synthetic>", device="cuda", dtype="bfloat16",
        quantization="fp8" if bc.fp8 else "none", kv_cache_dtype="fp8_e4m3" if bc.fp8 else "bfloat16",
        attention_backend="flashinfer", cascade_attention=bc.cascade, kv_cache_tokens=kv_tokens,
        cuda_graphs=bc.graphs, max_wave_rows=bc.rows_per_wave, beam_attention=bc.beam_attention,
        prefill_attention=bc.prefill_attention, max_context=bc.prompt_len + 8, max_requests=max(per_wave, 1) + 1, show_progress=False,
    )  # fmt: skip
    runner = ModelRunner(random_model(shape, cfg, bc.seed))
    layout = sid_layout_at_end(runner.config.vocab_size, bc.level_sizes)
    codes = random_catalog(bc.level_sizes, bc.catalog_size, bc.seed)
    trie = build_trie(codes, bc.level_sizes).to(runner.device)
    head = RestrictedLMHead(
        runner.lm_head(), runner.lm_head_bias(), layout, logit_softcap=runner.final_logit_softcap
    )
    catalog = torch.from_numpy(codes).to(runner.device)
    return BeamWave(runner, head, trie, layout), shape, catalog


def run_bench(bc: BenchConfig) -> dict[str, Any]:
    wave, shape, catalog = _build(bc)
    runner, layout = wave.runner, wave.sid
    requests = synthetic_requests(
        RequestSpec(bc.num_requests, bc.prompt_len, bc.shared_prefix, bc.n), layout, bc.seed
    )
    plan = plan_waves(
        requests, depth=len(bc.level_sizes), max_rows=bc.rows_per_wave,
        max_requests=len(runner.request_table.lengths), kv_slots=runner.allocator.num_slots - 1,
    )  # fmt: skip
    waves = [[requests[i] for i in wave] for wave in plan]
    # Warm-up (JIT compiles, allocator growth, one CUDA-graph capture per wave shape) on other
    # prompts with the same shared prefix, so the measured waves find only that prefix in the
    # prefix cache, never a whole prompt.
    for i, size in enumerate(sorted({len(g) for g in waves}, reverse=True)):
        warm = RequestSpec(size, bc.prompt_len, bc.shared_prefix, bc.n)
        wave.run(synthetic_requests(warm, layout, bc.seed, body_seed=bc.seed + 1 + i))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    stats_before = _graph_counts(wave)
    ends = []
    outputs = []
    with wave.recording() as marks:
        for group in waves:
            outputs.append(wave.run(group))
            ends.append(marks[-1][1])
    torch.cuda.synchronize()
    start = marks[0][1]
    wave_ms = [start.elapsed_time(e) for e in ends]
    stages = _stage_times(marks)
    total_s = wave_ms[-1] / 1e3
    latencies = np.repeat(wave_ms, [len(g) for g in waves])
    result: dict[str, Any] = {
        "config": asdict(bc),
        "gpu": torch.cuda.get_device_name(),
        "attention": _attention_name(wave.runner, bc.cascade),
        "waves": len(waves),
        "wave_end_ms": wave_ms,
        "requests_per_s": bc.num_requests / total_s,
        "prefill_tokens_per_s": bc.num_requests * bc.prompt_len / (sum(stages["prefill"]) / 1e3),
        "prefill_ms_per_wave": float(np.mean(stages["prefill"])),
        "decode_step_ms_full_wave": float(np.mean(stages["decode"])),
        "latency_p50_ms": float(np.percentile(latencies, 50)),
        "latency_p99_ms": float(np.percentile(latencies, 99)),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        **_graph_window(wave, stats_before, len(stages["decode"])),
        **_check_results(outputs, catalog),
        "fused_paths": sorted(runner.loaded.context.fused),
    }
    result.update(_roofline(bc, runner, waves, total_s))
    if bc.profile_path:
        fresh = RequestSpec(len(waves[0]), bc.prompt_len, bc.shared_prefix, bc.n)
        _profile(wave, synthetic_requests(fresh, layout, bc.seed, body_seed=bc.seed + 100),
                 bc.profile_path)  # fmt: skip
    if bc.hf_baseline:
        from flashrec_core.bench.hf_baseline import hf_requests_per_s

        hf_rps = hf_requests_per_s(
            shape, requests[: bc.hf_requests], bc.n, bc.hf_batch, len(bc.level_sizes)
        )
        result["hf_requests_per_s"] = hf_rps
        result["speedup_vs_hf"] = result["requests_per_s"] / hf_rps
    return result


def _profile(wave: BeamWave, requests: list[GenerationRequest], path: str) -> None:
    """One more wave under torch.profiler: where the step time goes (kernels vs host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wave.run(requests)
        torch.cuda.synchronize()
    by_cuda = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    by_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    with open(path, "w") as f:
        f.write("# sorted by CUDA time\n" + by_cuda + "\n# sorted by CPU time\n" + by_cpu)


def _check_results(outputs: list[WaveOutput], catalog: torch.Tensor) -> dict[str, int]:
    """Every live beam must name a catalog item (its codes = the catalog row it landed on);
    a 1M-item catalog reaches every n here, so dead beams should be 0 too."""
    invalid = dead = 0
    for out in outputs:
        alive = torch.isfinite(out.scores)
        dead += int((~alive).sum())
        rows = out.nodes[alive]
        invalid += int((catalog[rows] != out.codes[alive]).any(dim=1).sum())
    return {"invalid_sids": invalid, "dead_beams": dead}


def _graph_counts(wave: BeamWave) -> tuple[int, int]:
    stats = wave.graphs.stats if wave.graphs is not None else None
    return (stats.replays, stats.eager_steps) if stats is not None else (0, 0)


def _graph_window(wave: BeamWave, before: tuple[int, int], decode_steps: int) -> dict[str, Any]:
    """Replays vs eager beam steps inside the measured window (eager = graphs off or a fallback)."""
    replays, eager = _graph_counts(wave)
    out: dict[str, Any] = {"graph_replays": replays - before[0]}
    if wave.graphs is None:
        out["eager_steps"] = decode_steps
    else:
        out["eager_steps"] = eager - before[1]
        out["eager_reasons"] = dict(wave.graphs.stats.eager_reasons)
        out["graph_captures"] = wave.graphs.stats.captures
        out["graph_capture_s"] = wave.graphs.stats.capture_seconds
    return out


def _stage_times(marks: list[tuple[str, torch.cuda.Event]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"prefill": [], "decode": []}
    for (_, a), (name, b) in zip(marks, marks[1:]):
        if name == "start":
            continue
        out["prefill" if name == "prefill" else "decode"].append(a.elapsed_time(b))
    return out


def _roofline(bc: BenchConfig, runner: ModelRunner, waves: list, total_s: float) -> dict[str, Any]:
    peaks = measure_peaks(bc.fp8, runner.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weight_bytes -= runner.lm_head().numel() * runner.lm_head().element_size()  # restricted head
    kv_bytes = 1 if bc.fp8 else 2
    floor = 0.0
    for group in waves:
        cost = wave_cost(
            runner.config, peaks, [len(r.prompt_ids) for r in group], [r.n for r in group],
            bc.level_sizes, weight_bytes, kv_bytes, bc.cascade,
        )  # fmt: skip
        floor += cost.floor_seconds
    return {
        **peaks.fields(),
        "roofline_requests_per_s": bc.num_requests / floor,
        "percent_of_roofline": 100 * floor / total_s,
    }


def _attention_name(runner: ModelRunner, cascade: bool) -> str:
    """How beam steps attend: the Triton beam kernel, or FlashInfer's cascade / flat decode."""
    name = runner.attn_backend.name
    if runner.beam_attention == "triton":
        return name
    return f"{name} {'cascade' if cascade else 'flat'}"


def print_table(result: dict[str, Any]) -> None:
    keys = [
        "gpu", "attention", "waves", "requests_per_s", "prefill_tokens_per_s", "prefill_ms_per_wave",
        "decode_step_ms_full_wave", "latency_p50_ms", "latency_p99_ms", "peak_memory_gib",
        "roofline_requests_per_s", "percent_of_roofline", "graph_replays", "eager_steps",
        "graph_captures", "invalid_sids", "dead_beams",
        "hf_requests_per_s", "speedup_vs_hf",
    ]  # fmt: skip
    for k in keys:
        if k in result:
            v = result[k]
            print(f"{k:28s} {v:,.2f}" if isinstance(v, float) else f"{k:28s} {v}")


def main_bench(bc: BenchConfig, out: str | None) -> dict[str, Any]:
    result = run_bench(bc)
    print_table(result)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result
