"""End-to-end benchmarks of what users run: `Engine.generate` on a checkpoint directory, and the
unloaded single-request latency, on the same workload as the synthetic bench.

`write_bench_checkpoint` turns a bench preset into a real HF checkpoint directory (random bf16
weights by transformers, a tokenizer whose last tokens are the SID codebooks, a catalog file), so
the engine loads it like any user's model. Timing: each measured call returns host results (the
engine synchronizes when it copies a wave's beams back), so the wall clock around it is the
latency a caller sees, host work included.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrec_core.bench.roofline import Peaks, floor_seconds, measure_peaks_beside, served_model
from flashrec_core.bench.workload import RequestSpec, random_catalog, synthetic_requests
from flashrec_core.engine.requests import GenerationRequest

FILL_CALLS = 64
"""At most this many cache-fill calls (`_fill_prefix_cache`), body seeds seed + 200 onwards."""


def write_bench_checkpoint(
    shape: dict[str, Any], level_sizes: tuple[int, ...], catalog_size: int, out: Path, seed: int = 0
) -> Path:
    """config.json + model.safetensors (bf16, random) + tokenizer + catalog.json under `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(shape)
    model_type = cfg.pop("model_type")
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(model_type, **cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    _bench_tokenizer(config.vocab_size, level_sizes).save_pretrained(out)
    codes = random_catalog(level_sizes, catalog_size, seed)
    sids = {",".join(map(str, row)): f"item-{i}" for i, row in enumerate(codes.tolist())}
    # one attribute per item (100 categories) for the attribute-filter bench
    items = {f"item-{i}": {"category": f"c{i % CATEGORIES}"} for i in range(len(sids))}
    (out / "catalog.json").write_text(json.dumps({"sids": sids, "items": items}))
    return out


def _bench_tokenizer(vocab_size: int, level_sizes: tuple[int, ...]) -> Any:
    """Word-level tokens t0.. for ordinary ids, then the SID codebooks and <|sid_begin|> /
    <|sid_end|> as the last ids (the layout `sid_layout_at_end` describes)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flashrec_core.testing.checkpoint import sid_token

    words = vocab_size - sum(level_sizes) - 2
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(words)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    sids = [sid_token(lv, c) for lv, size in enumerate(level_sizes) for c in range(size)]
    tok.add_tokens([AddedToken(t, normalized=False) for t in sids])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|sid_begin|>", "<|sid_end|>")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


CATEGORIES = 100
"""Distinct `category` values in the bench catalog's item metadata."""


def bench_engine(
    model_dir: Path, n: int, num_requests: int, prompt_len: int, shared_prefix: int,
    level_sizes: tuple[int, ...], seed: int = 0, single_runs: int = 20,
    exclude_items: int = 0, allow_items: int = 0, filter_categories: int = 0,
    cache_fill: float = 0.9, engine_settings: dict[str, Any] | None = None,
    trace_dir: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Engine.generate throughput over fresh requests after a warm-up on other prompts (same
    shapes, same shared prefix) that also fills the prefix cache as a running server's is,
    and the latency of one request alone. With `exclude_items` /
    `allow_items`, every request carries an item filter of that many random catalog items; with
    `filter_categories`, an attribute filter allowing that many random categories of
    `CATEGORIES`
    (built before the clock starts, as a server builds it before submitting).
    `engine_settings`: EngineConfig fields that differ from their defaults (e.g. `schedule`).
    `trace_dir`: afterwards, one more call of the same size on other fresh prompts under a
    torch.profiler window over the loop (`trace_engine_call`); untimed, since the profiler
    slows what it watches."""
    from flashrec_core.config import EngineConfig, SearchConfig
    from flashrec_core.engine.engine import Engine
    from flashrec_core.engine.heap import frozen_heap

    cfg = EngineConfig(model_path=str(model_dir), show_progress=False, **(engine_settings or {}))
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(model_dir / "catalog.json")))
    layout = engine.layout
    spec = RequestSpec(num_requests, prompt_len, shared_prefix, n)
    filtered = bool(exclude_items or allow_items or filter_categories)

    def workload(body_seed: int) -> list[GenerationRequest]:
        reqs = synthetic_requests(spec, layout, seed, body_seed=body_seed)
        if filtered:  # built before the clock starts, as a server builds them before submitting
            reqs = _with_filters(engine, reqs, exclude_items, allow_items, filter_categories,
                                 body_seed)  # fmt: skip
        return reqs

    for i in range(2):  # warm-up: JIT, graph captures of every wave shape, allocator growth
        engine.generate(workload(seed + 1 + i))
    _fill_prefix_cache(engine, spec, seed, cache_fill)
    requests = workload(seed + 100)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with frozen_heap():  # as `flashrec serve` and `generate --input` run (engine/heap.py)
        waited = engine.loop.stats().results_wait_seconds
        start = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - start
        waited = engine.loop.stats().results_wait_seconds - waited
        single = _single_latencies(engine, RequestSpec(1, prompt_len, shared_prefix, n), seed,
                                   single_runs)  # fmt: skip
    latencies = [1e3 * sum((r.timings.queue_s, r.timings.prefill_s, r.timings.decode_s))
                 for r in results if r.timings is not None]  # fmt: skip
    runner = engine.runner
    ecfg = runner.loaded.engine_config
    roofline = _roofline(engine, requests, level_sizes) if cuda else None  # no peaks on CPU
    floor, peaks = roofline if roofline is not None else (None, None)
    graphs, prefill = engine.wave.graphs, engine.wave.prefill_graphs
    # body seeds: warm-up seed + 1 and 2, the measured call seed + 100, the cache fill seed + 200
    # onwards; the traced call's prompts come after the fill's, so they are fresh, not cached
    traced = workload(seed + 200 + FILL_CALLS) if trace_dir else None
    trace = trace_engine_call(engine, traced, trace_dir) if traced is not None else None
    return {
        "path": "Engine.generate",
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "n": n,
        "requests": num_requests,
        "requests_per_s": num_requests / seconds,
        "percent_of_roofline": 100 * floor / seconds if floor else None,
        "roofline_requests_per_s": num_requests / floor if floor else None,
        **(peaks.fields() if peaks is not None else {}),
        # of the measured call, the loop blocked on finished beams: the GPU ahead of the host
        "results_wait_share": waited / seconds,
        "latency_p50_ms": float(np.percentile(latencies, 50)),
        "latency_p99_ms": float(np.percentile(latencies, 99)),
        "single_request_p50_ms": float(np.percentile(single, 50)),
        "single_request_p99_ms": float(np.percentile(single, 99)),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "kv_pool_gib": runner.kv_pool.nbytes / 2**30,
        "kv_slots_peak_used": engine.loop.stats().kv_slots_peak_used,  # warm-up included
        "invalid_results": engine.loop.stats().invalid_results,
        "short_results": sum(len(r.choices) < n for r in results),
        "graph_replays": graphs.stats.replays if graphs else 0,
        "eager_steps": graphs.stats.eager_steps if graphs else None,
        "prefill_replays": prefill.stats.replays if prefill else 0,
        "eager_prefills": prefill.stats.eager if prefill else None,
        "prefill_graph_failures": list(prefill.stats.failed.values()) if prefill else None,
        # `--prefill-attention fresh`: prefill plans by path (attention/fresh_prefill.py)
        "fresh_prefill_paths": dict(getattr(runner.attn_backend, "prefills", {})),
        "exclude_items": exclude_items,
        "allow_items": allow_items,
        "filter_categories": filter_categories,
        "kv_cache_dtype": ecfg.kv_cache_dtype,
        "quantization": ecfg.quantization,
        "schedule": ecfg.schedule,
        "prefill_attention": ecfg.prefill_attention,
        "prefill_tokens_per_step": ecfg.prefill_tokens_per_step,
        "host_threads": engine.loop.intra_op_threads,
        "fp8_gemm_triton_rows": ecfg.fp8_gemm_triton_rows,
        "fp8_attention_scores": ecfg.fp8_attention_scores,
        "merge_beam_steps": engine.wave.merge_steps,
        "beam_steps": engine.loop.stats().beam_steps,  # warm-up included, as kv_slots_peak_used
        "beam_forwards": engine.loop.stats().beam_forwards,
        "mixed_prefill_steps": engine.loop.mixed_prefill_steps and engine.wave.mixes_prefills,
        "mixed_forwards": engine.loop.stats().mixed_forwards,  # warm-up included
        "mixed_prefill_tokens": graphs.mixed_tokens if graphs else None,
        "mixed_step_replays": graphs.stats.mixed_replays if graphs else 0,
        "merged_step_replays": graphs.stats.merged_replays if graphs else 0,
        **({"trace": trace} if trace is not None else {}),
    }


def trace_engine_call(
    engine: Any, requests: list[GenerationRequest], directory: Path
) -> dict[str, Any]:
    """One `Engine.generate` call under a profiler window over the engine loop (the window a
    server's /start_profile opens, here on the calling thread, which drives the loop): where
    the trace and its operator table went, and the loop summary (bench/trace_summary.py: host
    and GPU ms an iteration per loop phase, GPU busy share, top kernels)."""
    from flashrec_core.bench.trace_summary import load_events, summarize
    from flashrec_core.engine.heap import frozen_heap

    engine.loop.start_trace()
    try:
        with frozen_heap():
            results = engine.generate(requests)
    finally:
        trace, table = engine.loop.stop_trace(directory)
    return {
        "trace": str(trace),
        "table": str(table),
        "loop": summarize(load_events(trace)),
        # the share of prompt tokens the prefix cache held: the shared prefix alone for fresh
        # prompts, as in the measured call
        "cached_token_share": sum(r.cached_tokens for r in results)
        / sum(r.prompt_tokens for r in results),
    }


def _fill_prefix_cache(engine: Any, spec: RequestSpec, seed: int, share: float = 0.9) -> None:
    """Run other prompts until the prefix cache holds `share` of the pool: a server in steady
    state has a full cache, so admissions pay for eviction (the measured call must too)."""
    runner = engine.runner
    cache = runner.prefix_cache
    for i in range(FILL_CALLS):
        if cache is None or cache.num_cached >= share * (runner.allocator.num_slots - 1):
            return
        engine.generate(synthetic_requests(spec, engine.layout, seed, body_seed=seed + 200 + i))


def _with_filters(
    engine: Any, requests: list[GenerationRequest], exclude: int, allow: int, categories: int,
    seed: int,
) -> list[GenerationRequest]:  # fmt: skip
    from dataclasses import replace

    rng = np.random.default_rng(seed + 7)
    items = engine.catalog_index.item_ids
    out = []
    for req in requests:
        ex = (
            [items[i] for i in rng.choice(len(items), size=exclude, replace=False)]
            if exclude
            else ()
        )
        al = (
            [items[i] for i in rng.choice(len(items), size=allow, replace=False)] if allow else None
        )
        attrs = (
            {"category": [f"c{c}" for c in rng.choice(CATEGORIES, size=categories, replace=False)]}
            if categories
            else None
        )
        out.append(replace(req, item_filter=engine.create_filter(ex, al, attrs)))
    return out


def _single_latencies(engine: Any, spec: RequestSpec, seed: int, runs: int) -> list[float]:
    out = []
    for i in range(runs + 2):
        [req] = synthetic_requests(spec, engine.layout, seed, body_seed=seed + 1000 + i)
        start = time.perf_counter()
        engine.generate([req])
        if i >= 2:  # the first two warm the single-request graph shapes
            out.append(1e3 * (time.perf_counter() - start))
    return out


def _roofline(
    engine: Any, requests: list[GenerationRequest], level_sizes: tuple[int, ...]
) -> tuple[float, Peaks] | None:
    """The roofline floor of the same requests, as the synthetic bench computes it, and the
    peaks it rests on; None when the card has no room left beside the engine to measure them."""
    served = served_model(engine)
    peaks = measure_peaks_beside(served.fp8, engine.runner.device, "engine")
    if peaks is None:
        return None
    shapes = [(len(r.prompt_ids), r.n) for r in requests]
    return floor_seconds(engine.runner.config, served, peaks, shapes, level_sizes), peaks
