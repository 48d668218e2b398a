"""Where one unloaded request's time goes: host (Python, launches, syncs) against GPU kernels.

Runs `Engine.generate` on one request at a time after a warm-up, under torch.profiler (CPU and
CUDA activities), and writes per width: the request's host wall time (generate returns host
results, so the wall clock includes all GPU work), the summed GPU kernel time, kernel and graph
launch counts, the CUDA runtime calls that block the host, and the top operators by host and by
GPU time, and a cProfile of the same calls (the Python time between operators). Usage on the GPU machine:

    python3 scripts/profile_request.py /tmp/bench-ckpt OUT_DIR [--widths 50,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashrec_core.bench.workload import RequestSpec, synthetic_requests
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.heap import frozen_heap

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _profile_width(engine: Engine, n: int, repeats: int, out: Path, tag: str = "") -> str:
    spec = RequestSpec(1, 1024, 64, n)
    # prompts of their own per width: the second width reusing the first's bodies found them in
    # the prefix cache and timed a prefill of a few tokens (session 19's first run)
    fresh = 1000 * n
    for seed in range(3):  # warm-up at this width: graphs, allocator, JIT
        engine.generate(
            synthetic_requests(spec, engine.layout, seed=0, body_seed=fresh + 100 + seed)
        )
    walls = []
    for seed in range(repeats):  # unprofiled wall time: the profiler's own overhead is large
        reqs = synthetic_requests(spec, engine.layout, seed=0, body_seed=fresh + 200 + seed)
        start = time.perf_counter()
        engine.generate(reqs)
        walls.append((time.perf_counter() - start) * 1e3)
    host = cProfile.Profile()  # Python time between operators, which the profiler omits
    for seed in range(repeats):
        reqs = synthetic_requests(spec, engine.layout, seed=0, body_seed=fresh + 400 + seed)
        host.runcall(engine.generate, reqs)
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(35)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for seed in range(repeats):
            engine.generate(
                synthetic_requests(spec, engine.layout, seed=0, body_seed=fresh + 300 + seed)
            )
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / repeats
    launches = sum(
        e.count
        for e in events
        if e.key
        in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    )
    graphs = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    blocking = {
        e.key: (e.count // repeats, e.cpu_time_total / 1e3 / repeats)
        for e in events
        if e.key.startswith(BLOCKING)
    }
    lines = [
        f"## n={n}, one request of 1,024 tokens, {repeats} repeats",
        f"wall ms per request (unprofiled): median {statistics.median(walls):.1f}, "
        f"min {min(walls):.1f}",
        f"GPU kernel ms per request: {gpu_ms:.2f}",
        f"per request: {launches // repeats} kernel launches, {graphs // repeats} graph launches",
        "blocking runtime calls per request (count, host ms): "
        + ", ".join(f"{k} {c} / {ms:.2f}" for k, (c, ms) in blocking.items()),
        "",
        "top operators by self host time:",
        events.table(sort_by="self_cpu_time_total", row_limit=30),
        "top kernels by GPU time:",
        events.table(sort_by="self_cuda_time_total", row_limit=25),
        f"cProfile of {repeats} requests (Python, by own time):",
        text.getvalue(),
    ]
    prof.export_chrome_trace(str(out / f"trace_request_n{n}{tag}.json"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--widths", default="50,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--prefill-attention", choices=["auto", "backend", "triton", "fresh"], default="auto",
        help="EngineConfig field",
    )  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    args = ap.parse_args()
    ckpt, out = Path(args.checkpoint), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = EngineConfig(
        model_path=str(ckpt), show_progress=False, prefill_attention=args.prefill_attention,
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(ckpt / "catalog.json")))
    # the heap frozen as `flashrec serve` and `bench --engine` freeze it: otherwise collector
    # passes over the catalog's million objects land inside the timed requests (the cProfile of
    # session 19's run put 0.75 ms a call in inference_mode.__exit__, likely collector passes)
    with frozen_heap():
        for n in (int(w) for w in args.widths.split(",")):
            text = _profile_width(engine, n, args.repeats, out, args.tag)
            (out / f"profile_request_n{n}{args.tag}.txt").write_text(text)
            print(text.split("top operators")[0], flush=True)


if __name__ == "__main__":
    main()
