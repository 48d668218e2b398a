"""FlashRec against the published reference engine (PyPI `flashrec` 0.1.2) on one GPU, one run.

Both engines load the same checkpoint directory (written by `flashrec bench --write-checkpoint`)
and the same catalog, and get the very same token-id prompts: `synthetic_requests` with the
checkpoint's SID layout (prompt_len tokens sharing a shared_prefix-token prefix, ending in
<|sid_begin|>), with the body seeds `bench_engine` uses. Per beam width it measures

* throughput: the wall clock around one call that returns host results (the reference's
  `generate_many`, our `Engine.generate` via `flashrec_core.bench.e2e.bench_engine`) over
  fresh prompts, after two warm-up calls on other prompts of the same shapes and a fill of the
  prefix cache to 90% of the KV pool (as bench_engine does);
* unloaded latency: one request alone, `single_runs` runs after 2 warm-ups, fresh prompts each;
* sanity: both return n SIDs per request; the top-n SID sets of the two engines overlap on a
  few more prompts (same weights, FP8 on both: high but not perfect).

The reference runs first and is freed (del, gc, empty_cache) before ours is built, since ours
sizes its KV pool from the free memory. Every phase is written to OUT/compare_reference.json
as soon as it is measured, and a failed phase records its error and lets the others run.

Usage: python3 scripts/compare_reference.py --ckpt /tmp/bench-ckpt --out DIR
       [--widths 50,512] [--requests 400,64] [--cache-fill 0.9] [--skip-ours] [--dry-run]
(the reference must be importable as `flashrec`: scripts/gpu_run.sh `compare` installs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from flashrec_core.bench.e2e import bench_engine
from flashrec_core.bench.workload import RequestSpec, synthetic_requests
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.search import Catalog, SidLayout, SidLayoutError, infer_sid_layout, load_catalog

T = TypeVar("T")
WARMUP_BODY_SEEDS = (1, 2)  # offsets from --seed, as bench_engine warms up
MEASURED_BODY_SEED = 100
FILL_BODY_SEED = 200
SINGLE_BODY_SEED = 1000
OVERLAP_BODY_SEED = 5000  # prompts neither engine measured or warmed up on
SINGLE_WARMUPS = 2


@dataclass(frozen=True)
class CompareSpec:
    ckpt: Path
    out: Path
    widths: tuple[int, ...]
    requests: tuple[int, ...]
    prompt_len: int
    shared_prefix: int
    single_runs: int
    overlap_requests: int
    ref_mem_fraction: float
    seed: int
    cache_fill: float
    skip_ours: bool
    dry_run: bool


@dataclass(frozen=True)
class Setup:
    """What both engines share: the SID layout, our catalog, the reference's copy of it."""

    layout: SidLayout
    catalog: Catalog
    ref_catalog: Path
    ref_sid: dict[str, str]


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    """The JSON results, rewritten whole after every phase so a timeout keeps what was done."""

    def __init__(self, spec: CompareSpec) -> None:
        self.path = spec.out / "compare_reference.json"
        self.data: dict[str, Any] = {"workload": _workload(spec), "environment": _environment()}
        self.widths = spec.widths

    def record(self, where: str, value: Any) -> None:
        *parents, key = where.split(".")
        node = self.data
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = value
        self.write()

    def get(self, where: str) -> Any:
        node: Any = self.data
        for name in where.split("."):
            if not isinstance(node, dict) or name not in node:
                return None
            node = node[name]
        return node

    def write(self) -> None:
        self.data["table"] = markdown_table(self)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)
        self.path.with_suffix(".md").write_text(self.data["table"] + "\n")


def run_phase(report: Report, where: str, fn: Callable[[], T], keep: bool = True) -> T | None:
    """Run one phase and record its value at `where` (with `keep`); on failure record its error
    there instead and return None (the device run is expensive: a failure in one phase must
    not lose the others)."""
    log(f"{where} ...")
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # any failure of a phase is a result to report, not a crash
        report.record(where, {"error": f"{type(exc).__name__}: {exc}", "traceback": _tb()})
        log(f"{where} FAILED after {time.perf_counter() - start:.1f}s: {type(exc).__name__}: {exc}")
        return None
    log(f"{where} done in {time.perf_counter() - start:.1f}s")
    if keep:
        report.record(where, value)
    return value


def _tb() -> list[str]:
    return traceback.format_exc(limit=12).splitlines()[-24:]


def _workload(spec: CompareSpec) -> dict[str, Any]:
    return {
        "ckpt": str(spec.ckpt),
        "widths": list(spec.widths),
        "requests": list(spec.requests),
        "prompt_len": spec.prompt_len,
        "shared_prefix": spec.shared_prefix,
        "single_runs": spec.single_runs,
        "single_warmups": SINGLE_WARMUPS,
        "overlap_requests": spec.overlap_requests,
        "cache_fill": spec.cache_fill,
        "seed": spec.seed,
        "dry_run": spec.dry_run,
    }


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for dist in ("flashrec", "flashrec-core", "flashinfer-python", "apache-tvm-ffi", "sgl-kernel"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    try:
        import flashrec

        env["flashrec_module"] = {"version": flashrec.__version__, "file": flashrec.__file__}
    except ImportError as exc:
        env["flashrec_module"] = {"error": str(exc)}
    return env


def markdown_table(report: Report) -> str:
    """Rows: throughput and unloaded latency per width; columns: reference, FlashRec, ratio
    (>1: FlashRec faster), the top-n SID-set overlap of the two engines, and the share of the
    reference's returned SIDs that are not in the catalog (ours: `invalid_results`)."""
    lines = [
        "| metric | reference | FlashRec | ratio (>1: FlashRec faster) | top-n overlap "
        "| reference SIDs not in catalog |",
        "|---|---|---|---|---|---|",
    ]
    for n in report.widths:
        ref = report.get(f"reference.n{n}.throughput.requests_per_s")
        ours = report.get(f"flashrec.n{n}.requests_per_s")
        ratio = ours / ref if ref and ours else None
        ov = report.get(f"overlap.n{n}.mean")
        bad = report.get(f"reference.n{n}.throughput.not_in_catalog_share")
        cells = (_f(ref), _f(ours), _f(ratio), _f(ov), _f(bad))
        lines.append(f"| n={n} throughput (req/s) | {' | '.join(cells)} |")
    for n in report.widths:
        ref = report.get(f"reference.n{n}.single.single_request_p50_ms")
        ours = report.get(f"flashrec.n{n}.single_request_p50_ms")
        ratio = ref / ours if ref and ours else None
        cells = (_f(ref), _f(ours), _f(ratio), "", "")
        lines.append(f"| unloaded n={n} latency p50 (ms) | {' | '.join(cells)} |")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    if not isinstance(x, (int, float)):
        return "—"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


# -- setup: layout, catalog, prompts -----------------------------------------------------------


def load_setup(spec: CompareSpec, tmp: Path) -> Setup:
    """Our SID layout from the checkpoint's tokenizer, our catalog, and the reference's
    sid2vid copy of it (unique SIDs as {"c1,c2,c3": 1}, the format its catalog tool writes)."""
    from transformers import AutoTokenizer

    if not (spec.ckpt / "config.json").is_file():
        raise FileNotFoundError(
            f"{spec.ckpt} has no config.json; write the checkpoint first with `flashrec bench "
            f"--preset qwen3-1.7b --write-checkpoint {spec.ckpt}`"
        )
    tok = AutoTokenizer.from_pretrained(str(spec.ckpt), local_files_only=True)
    layout = infer_sid_layout(tok.get_vocab())
    catalog = load_catalog(spec.ckpt / "catalog.json", layout.level_sizes)
    layout.check_catalog_depth(catalog.depth, source=f"catalog {spec.ckpt / 'catalog.json'}")
    ref_catalog = tmp / "sid2vid_reference.json"
    write_reference_catalog(catalog.codes, ref_catalog)
    return Setup(layout, catalog, ref_catalog, reference_sid_fields(layout))


def write_reference_catalog(codes: np.ndarray, path: Path) -> None:
    """codes int64 [num_sids, depth] -> {"c1,c2,c3": 1, ...}; the reference reads only keys."""
    columns = (map(str, col) for col in codes.T.tolist())
    keys = map(",".join, zip(*columns))
    with path.open("w", encoding="utf-8") as f:
        f.write("{" + ",".join(f'"{key}":1' for key in keys) + "}")


def reference_sid_fields(layout: SidLayout) -> dict[str, str]:
    """The reference's three SID layout fields, given explicitly so that both engines use our
    layout (with all three set it skips its own inference from the tokenizer files)."""
    if layout.begin_token_id is None or layout.end_token_id is None:
        raise SidLayoutError(
            "the checkpoint's tokenizer lacks <|sid_begin|> / <|sid_end|>; the reference needs "
            "both (sid_boundary_tokens); write the checkpoint with `flashrec bench "
            "--write-checkpoint`"
        )
    return {
        # a closed range of the codebook token ids; level l code c = start + sum(sizes[:l]) + c
        "sid_token_range": f"{layout.sid_start}:{layout.sid_end - 1}",
        "sid_codebook_sizes": ",".join(map(str, layout.level_sizes)),
        "sid_boundary_tokens": f"{layout.begin_token_id},{layout.end_token_id}",
    }


def describe_setup(spec: CompareSpec, setup: Setup) -> dict[str, Any]:
    layout = setup.layout
    return {
        "level_sizes": list(layout.level_sizes),
        "sid_start": layout.sid_start,
        "begin_token_id": layout.begin_token_id,
        "end_token_id": layout.end_token_id,
        "catalog_sids": len(setup.catalog),
        "catalog_items": setup.catalog.num_items,
        "reference_catalog": str(setup.ref_catalog),
        "reference_sid_fields": setup.ref_sid,
        "reference_inference": reference_inference(spec, setup),
    }


def reference_inference(spec: CompareSpec, setup: Setup) -> dict[str, Any]:
    """What the reference would infer from the tokenizer + its catalog copy: it must agree with
    the explicit fields (same codebook tokens, same boundary tokens)."""
    try:
        from flashrec.config import same_sid_ids
        from flashrec.sid_layout import infer_sid_layout as ref_infer

        got = ref_infer(str(spec.ckpt), str(setup.ref_catalog))
    except (ImportError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    inferred = {
        "sid_token_range": got.token_range,
        "sid_codebook_sizes": got.codebook_sizes,
        "sid_boundary_tokens": got.boundary_tokens,
    }
    agrees = all(same_sid_ids(setup.ref_sid[k], v) for k, v in inferred.items())
    return {**inferred, "agrees": agrees}


def request_spec(spec: CompareSpec, n: int, num: int) -> RequestSpec:
    return RequestSpec(num, spec.prompt_len, spec.shared_prefix, n)


def prompts(
    spec: CompareSpec, layout: SidLayout, rs: RequestSpec, body: int
) -> list[GenerationRequest]:
    """bench_engine's prompts: the shared prefix from --seed, the body from --seed + body."""
    return synthetic_requests(rs, layout, spec.seed, body_seed=spec.seed + body)


def check_prompts(spec: CompareSpec, setup: Setup) -> dict[str, Any]:
    """Dry run: every phase's prompts, checked for length, shared prefix and <|sid_begin|>."""
    out: dict[str, Any] = {}
    for n, num in zip(spec.widths, spec.requests):
        rs = request_spec(spec, n, num)
        batches = {f"warmup{b}": prompts(spec, setup.layout, rs, b) for b in WARMUP_BODY_SEEDS}
        batches["measured"] = prompts(spec, setup.layout, rs, MEASURED_BODY_SEED)
        one = request_spec(spec, n, 1)
        batches["single"] = [
            prompts(spec, setup.layout, one, SINGLE_BODY_SEED + i)[0]
            for i in range(spec.single_runs + SINGLE_WARMUPS)
        ]
        batches["overlap"] = prompts(
            spec, setup.layout, request_spec(spec, n, spec.overlap_requests), OVERLAP_BODY_SEED
        )
        out[f"n{n}"] = {name: _check_batch(spec, setup.layout, b) for name, b in batches.items()}
    return out


def _check_batch(spec: CompareSpec, layout: SidLayout, reqs: Sequence) -> dict[str, Any]:
    ids = [r.prompt_ids for r in reqs]
    prefix = ids[0][: spec.shared_prefix]
    bad = [
        i
        for i, p in enumerate(ids)
        if len(p) != spec.prompt_len
        or p[: spec.shared_prefix] != prefix
        or p[-1] != layout.begin_token_id
        or max(p[:-1]) >= layout.sid_start
    ]
    if bad:
        raise ValueError(f"prompts {bad[:5]} break the workload (length/prefix/sid_begin)")
    return {"requests": len(ids), "distinct": len(set(ids)), "n": reqs[0].n}


# -- the reference engine ----------------------------------------------------------------------


def graph_rows(n: int) -> int:
    """The reference's cuda_graph_max_bs = batch_slots (beam rows per step): its default 800,
    and 4096 from n=512 (its README: wide beams need --cuda-graph-max-bs 4096 --batch-slots
    4096; with 800 a 512-beam request fits one graph row set only)."""
    return 4096 if n >= 512 else 800


def reference_config(spec: CompareSpec, setup: Setup, n: int) -> Any:
    """One engine per width: its beam_width sets the CUDA-graph sizes (multiples of n) and the
    fused graph expand, which only replays for requests of exactly that width."""
    from flashrec import BeamRecConfig

    depth = setup.layout.depth
    return BeamRecConfig(
        model_path=str(spec.ckpt),
        sid_vocab_file=str(setup.ref_catalog),
        beam_width=n,
        max_tokens=depth,
        cuda_graph_max_bs=graph_rows(n),
        batch_slots=graph_rows(n),
        max_seq_len=1024 * -(-(spec.prompt_len + depth + 2) // 1024),
        mem_fraction_static=spec.ref_mem_fraction,
        **setup.ref_sid,
    )


def describe_reference_config(cfg: Any) -> dict[str, Any]:
    keys = (
        "beam_width", "max_tokens", "cuda_graph_max_bs", "batch_slots", "max_seq_len",
        "mem_fraction_static", "quantization", "kv_cache_dtype", "attention_backend",
        "max_running_requests", "enable_radix", "enable_cuda_graph", "sid_token_range",
        "sid_codebook_sizes", "sid_boundary_tokens",
    )  # fmt: skip
    out = {k: getattr(cfg, k) for k in keys}
    out["cuda_graph_sizes"] = cfg.resolved_cuda_graph_sizes()
    return out


def reference_requests(engine: Any, reqs: Sequence[GenerationRequest], n: int) -> list:
    """The reference's requests for our prompts; its make_request appends <|sid_begin|> only
    when the prompt does not end with it, so the ids must come back unchanged."""
    out = []
    for req in reqs:
        ids = list(req.prompt_ids)
        ref = engine.make_request(input_ids=ids, n=n, max_tokens=engine.config.max_tokens)
        if list(ref.input_ids) != list(req.prompt_ids):
            raise ValueError(
                f"the reference changed a prompt: {len(req.prompt_ids)} ids in, "
                f"{len(ref.input_ids)} out (last {ref.input_ids[-3:]} vs {req.prompt_ids[-3:]})"
            )
        out.append(ref)
    return out


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Wall seconds of a call that returns host results, after the device is idle."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def result_sids(result: Any, layout: SidLayout) -> list[tuple[int, ...] | None]:
    """One reference result's SIDs, best first (None: tokens that are not a SID)."""
    out: list[tuple[int, ...] | None] = []
    for seq in result.sequences:
        try:
            out.append(layout.decode(seq.tokens))
        except SidLayoutError:
            out.append(None)
    return out


def sid_checks(sids: list[list[tuple[int, ...] | None]], n: int, catalog: Catalog) -> dict:
    """Every request has n distinct SIDs, each in the catalog."""
    flat = [s for row in sids for s in row]
    missing = sum(s is None or catalog.row_of(s) < 0 for s in flat)
    return {
        "short_results": sum(len(row) < n for row in sids),
        "duplicate_sids": sum(len(row) - len(set(row)) for row in sids),
        "not_sids": sum(s is None for s in flat),
        "not_in_catalog": missing,
        "not_in_catalog_share": missing / max(len(flat), 1),
    }


def reference_throughput(spec: CompareSpec, setup: Setup, engine: Any, n: int, num: int) -> dict:
    layout, rs = setup.layout, request_spec(spec, n, num)
    for body in WARMUP_BODY_SEEDS:  # JIT, graph capture, allocator growth
        engine.generate_many(reference_requests(engine, prompts(spec, layout, rs, body), n))
    fills = fill_reference_cache(spec, setup, engine, rs, spec.cache_fill)
    reqs = reference_requests(engine, prompts(spec, layout, rs, MEASURED_BODY_SEED), n)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    results, seconds = timed(lambda: engine.generate_many(reqs))
    sids = [result_sids(r, layout) for r in results]
    scores = [seq.cum_logprob for r in results for seq in r.sequences]
    return {
        "requests_per_s": num / seconds,
        "seconds": seconds,
        "requests": num,
        "results": len(results),
        "cache_fill_calls": fills,
        "cached_tokens": sum(int(r.cached_tokens) for r in results),
        "peak_memory_gib": _peak_gib(),
        **sid_checks(sids, n, setup.catalog),
        # the reference masks each beam's top-2n tokens of a level by the catalog and keeps
        # the masked ones at -inf, so a beam with fewer valid ones among them returns SIDs
        # outside the catalog scored -inf (docs/benchmarks.md): this count should equal
        # not_in_catalog
        "negative_infinity_scores": sum(not np.isfinite(s) for s in scores),
    }


def fill_reference_cache(
    spec: CompareSpec, setup: Setup, engine: Any, rs: RequestSpec, share: float = 0.9
) -> int:
    """As bench_engine's _fill_prefix_cache: other prompts until the radix cache holds `share`
    of the KV pool, so the measured call pays for eviction as a server in steady state does."""
    cache, pool = engine.prefix_cache, engine.runner.kv_pool
    for i in range(64):
        if cache is None or cache.num_cached_tokens >= share * pool.num_tokens:
            return i
        body = prompts(spec, setup.layout, rs, FILL_BODY_SEED + i)
        engine.generate_many(reference_requests(engine, body, rs.n))
    return 64


def reference_runtime(engine: Any) -> dict[str, Any]:
    """Which of its fast paths the reference actually runs on this machine."""
    from flashrec.kernel import beam_trie, sglops

    graph = engine.runner.graph
    return {
        "kv_pool_tokens": int(engine.runner.kv_pool.num_tokens),
        "kv_dtype": str(engine.runner.kv_pool.dtype),
        "graphs": sorted(graph.graphs) if graph is not None else None,
        "graph_expand": sorted(graph.graphs_expand or ()) if graph is not None else None,
        "beam_trie_jit": beam_trie._MODULE is not None,
        "sgl_kernel": sglops.SGL is not None,
        "trie_dense": engine.valid_path._allow_table is not None,
    }


def reference_single(spec: CompareSpec, setup: Setup, engine: Any, n: int) -> dict[str, Any]:
    out = []
    one = request_spec(spec, n, 1)
    for i in range(spec.single_runs + SINGLE_WARMUPS):
        reqs = reference_requests(engine, prompts(spec, setup.layout, one, SINGLE_BODY_SEED + i), n)
        _, seconds = timed(lambda reqs=reqs: engine.generate_many(reqs))
        if i >= SINGLE_WARMUPS:  # the first ones warm the single-request graph shapes
            out.append(1e3 * seconds)
    return {
        "single_request_p50_ms": float(np.percentile(out, 50)),
        "single_request_p99_ms": float(np.percentile(out, 99)),
        "runs": len(out),
    }


def reference_overlap_sids(
    spec: CompareSpec, setup: Setup, engine: Any, n: int
) -> list[list[tuple[int, ...] | None]]:
    reqs = prompts(
        spec, setup.layout, request_spec(spec, n, spec.overlap_requests), OVERLAP_BODY_SEED
    )
    results = engine.generate_many(reference_requests(engine, reqs, n))
    return [result_sids(r, setup.layout) for r in results]


def reference_width(
    report: Report, spec: CompareSpec, setup: Setup, n: int, num: int
) -> list[list[tuple[int, ...] | None]] | None:
    """Build the reference for width n and measure it; return its overlap-prompt SIDs. The
    caller frees it (`release`) once this frame, which holds the engine, has returned."""
    where = f"reference.n{n}"
    cfg = run_phase(report, f"{where}.config", lambda: reference_config(spec, setup, n), False)
    if cfg is None:
        return None
    report.record(f"{where}.config", describe_reference_config(cfg))
    if spec.dry_run:
        return None
    engine = run_phase(
        report, f"{where}.build", lambda: _build_reference(report, where, cfg), False
    )
    if engine is None:
        return None
    try:
        return _measure_reference(report, spec, setup, engine, n, num)
    finally:
        engine.host_pool.shutdown()


def _measure_reference(
    report: Report, spec: CompareSpec, setup: Setup, engine: Any, n: int, num: int
) -> list[list[tuple[int, ...] | None]] | None:
    where = f"reference.n{n}"
    phases = (
        ("throughput", lambda: reference_throughput(spec, setup, engine, n, num)),
        ("single", lambda: reference_single(spec, setup, engine, n)),
        ("runtime", lambda: reference_runtime(engine)),
    )
    for name, fn in phases:
        value = run_phase(report, f"{where}.{name}", fn)
        if value is not None and _headline(value):
            log(f"{where}.{name}: {_headline(value)}")
    return run_phase(
        report, f"overlap.n{n}", lambda: reference_overlap_sids(spec, setup, engine, n), False
    )


def _build_reference(report: Report, where: str, cfg: Any) -> Any:
    from flashrec import BeamRecEngine

    report.record(f"{where}.free_gib_before_build", _free_gib())
    engine, seconds = timed(lambda: BeamRecEngine(cfg))
    report.record(f"{where}.build", {"seconds": seconds, "free_gib_after": _free_gib()})
    return engine


def _headline(value: dict[str, Any]) -> str:
    keys = ("requests_per_s", "single_request_p50_ms", "short_results", "not_in_catalog")
    return ", ".join(f"{k}={_f(value[k])}" for k in keys if k in value)


def release(report: Report, where: str) -> None:
    """Return an engine's memory to the device before the next one sizes its KV pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    report.record(where, {"free_gib": _free_gib()})


def _free_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0] / 2**30


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# -- our engine --------------------------------------------------------------------------------


def ours_width(report: Report, spec: CompareSpec, setup: Setup, n: int, num: int) -> None:
    where = f"flashrec.n{n}"
    level_sizes = tuple(setup.layout.level_sizes)
    value = run_phase(
        report,
        where,
        lambda: bench_engine(
            spec.ckpt,
            n,
            num,
            spec.prompt_len,
            spec.shared_prefix,
            level_sizes,
            seed=spec.seed,
            single_runs=spec.single_runs,
            cache_fill=spec.cache_fill,
        ),  # fmt: skip
    )
    if value is not None:
        log(f"{where}: {_headline(value)}")
    release(report, f"{where}_after_free")


def ours_overlap(
    report: Report,
    spec: CompareSpec,
    setup: Setup,
    ref: dict[int, list[list[tuple[int, ...] | None]]],
) -> None:
    """One engine of ours on the overlap prompts of every width the reference answered."""
    from flashrec_core.config import EngineConfig, SearchConfig
    from flashrec_core.engine.engine import Engine

    cfg = EngineConfig(model_path=str(spec.ckpt), show_progress=False)
    search = SearchConfig(catalog_path=str(spec.ckpt / "catalog.json"))
    engine = run_phase(report, "overlap.build", lambda: Engine.from_config(cfg, search), False)
    if engine is None:
        return
    for n, ref_sids in ref.items():
        rs = request_spec(spec, n, spec.overlap_requests)
        reqs = prompts(spec, setup.layout, rs, OVERLAP_BODY_SEED)
        value = run_phase(
            report, f"overlap.n{n}", lambda r=reqs, s=ref_sids: _overlap(engine, r, s)
        )
        if value is not None:
            log(f"overlap.n{n}: mean {value['mean']:.3f}, min {value['min']:.3f}")


def _overlap(
    engine: Any, reqs: Sequence[GenerationRequest], ref: list[list[tuple[int, ...] | None]]
) -> dict[str, Any]:
    """|top-n of ours ∩ top-n of the reference| / n per request, the same for the SIDs' prefixes
    without the last level (the level where the reference's choice is least constrained), and
    top-1 agreement."""
    ours = [[tuple(row) for row in r.codes.tolist()] for r in engine.generate(list(reqs))]
    shares = [len(set(a) & set(b)) / req.n for a, b, req in zip(ours, ref, reqs)]
    return {
        "requests": len(shares),
        "mean": float(np.mean(shares)),
        "min": float(np.min(shares)),
        "per_request": shares,
        "prefix_overlap": [_prefix_share(a, b) for a, b in zip(ours, ref)],
        "top1_agree": sum(bool(a and b and a[0] == b[0]) for a, b in zip(ours, ref)),
        "ours_counts": [len(a) for a in ours],
        "reference_counts": [len(b) for b in ref],
    }


def _prefix_share(ours: list[tuple[int, ...]], ref: list[tuple[int, ...] | None]) -> float:
    """Share of the reference's distinct SID prefixes (all levels but the last) that ours has."""
    theirs = {s[:-1] for s in ref if s is not None}
    return len(theirs & {s[:-1] for s in ours}) / max(len(theirs), 1)


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> CompareSpec:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="flashrec bench --write-checkpoint dir")
    p.add_argument("--out", type=Path, required=True, help="directory for compare_reference.json")
    p.add_argument("--widths", default="50,512", help="beam widths n, comma separated")
    p.add_argument("--requests", default="400,64", help="requests per width, comma separated")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--shared-prefix", type=int, default=64)
    p.add_argument("--single-runs", type=int, default=20, help="unloaded runs after 2 warm-ups")
    p.add_argument("--overlap-requests", type=int, default=4, help="prompts for the overlap check")
    p.add_argument("--ref-mem-fraction", type=float, default=0.8,
                   help="the reference's mem_fraction_static (its KV pool: 45%% of it x free)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-fill", type=float, default=0.9,
                   help="fill both prefix caches to this share of the KV pool before the timed "
                   "call (0: no fill; a server in steady state has a full cache)")  # fmt: skip
    p.add_argument("--skip-ours", action="store_true", help="run the reference only")
    p.add_argument("--dry-run", action="store_true",
                   help="layout, catalog conversion, configs and prompts; no engine is built")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="both engines' INFO logs")
    args = p.parse_args(argv)
    widths, requests = _ints(p, "--widths", args.widths), _ints(p, "--requests", args.requests)
    if len(widths) != len(requests):
        p.error(f"--widths has {len(widths)} values but --requests has {len(requests)}")
    if not 0 < args.shared_prefix < args.prompt_len:
        p.error(f"--shared-prefix must be in 1..{args.prompt_len - 1}, got {args.shared_prefix}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return CompareSpec(
        args.ckpt, args.out, widths, requests, args.prompt_len, args.shared_prefix,
        args.single_runs, args.overlap_requests, args.ref_mem_fraction, args.seed,
        args.cache_fill, args.skip_ours, args.dry_run,
    )  # fmt: skip


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        p.error(f"{flag} takes comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{flag} needs positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    spec = parse_args(argv)
    spec.out.mkdir(parents=True, exist_ok=True)
    report = Report(spec)
    report.write()
    with tempfile.TemporaryDirectory(prefix="compare-ref-") as tmp:
        setup = run_phase(report, "setup", lambda: load_setup(spec, Path(tmp)), False)
        if setup is None:
            return 1
        report.record("setup", describe_setup(spec, setup))
        if spec.dry_run:
            run_phase(report, "dry_run.prompts", lambda: check_prompts(spec, setup))
        ref: dict[int, list[list[tuple[int, ...] | None]]] = {}
        for n, num in zip(spec.widths, spec.requests):
            sids = reference_width(report, spec, setup, n, num)
            if not spec.dry_run:
                release(report, f"reference.n{n}.after_free")
            if sids is not None:
                ref[n] = sids
            if not (spec.skip_ours or spec.dry_run):
                ours_width(report, spec, setup, n, num)
        if ref and not spec.skip_ours:
            ours_overlap(report, spec, setup, ref)
            release(report, "overlap.after_free")
    print(report.data["table"], flush=True)
    log(f"wrote {report.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
