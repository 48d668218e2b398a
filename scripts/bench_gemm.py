"""The model's FP8 GEMMs alone, by row count: how efficient is a forward of a few requests?

Session 21's server runs (docs/benchmarks.md) put the GPU time of one n=50 request at ~8.5 ms in
waves of 2-3 requests against ~5.8 ms in waves of 100+, and an unloaded request's profile puts
half its GPU time in the FP8 GEMMs (`torch._scaled_mm`, cuBLAS). This script times each of the
bench preset's four projections (Qwen3-1.7B: hidden 2048, 16 q / 8 KV heads of 128,
intermediate 6144) exactly as `fp8_linear` calls them (per-token activation scales, per-channel
weight scales, bf16 out) at row counts from a beam step of one n=50 request to a full prefill
chunk, and reports TFLOP/s against the 8192^3 GEMM peak the roofline uses, and the time of a
whole forward's GEMMs (28 layers); then, at a few small row counts, the Triton small-row GEMM
(`flashrec_kernels.fp8_gemm`) with its default launch and a sweep of launches against it, the
fastest of each written as a launch table (`fp8_gemm_tuned.json`). Times are CUDA events
(`triton.testing.do_bench`, each launch from the host); with --graphs, replays of a CUDA graph of
the launches over several copies of the weights (GRAPHS), into `bench_gemm_graphs.json` and
`fp8_gemm_tuned_graphs.json`. Usage (on the GPU):

    python scripts/bench_gemm.py [OUT_DIR] [--graphs]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import triton.testing

HIDDEN, INTER, LAYERS = 2048, 6144, 28
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
PROJECTIONS = {  # name: (in, out)
    "qkv": (HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o": (Q_HEADS * HEAD_DIM, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}
ROWS = (50, 150, 512, 1024, 2048, 3072, 4096, 8184, 16368)
"""One n=50 request's beam step, three of them, then prefills of 0.5 to 16 requests of 1,024
tokens (8,184: the default prefill chunk)."""
DEV = torch.device("cuda")

GRAPHS = False
"""--graphs: time each GEMM as the engine's beam-step graphs run it, without a host launch
between calls. A Triton launch from Python costs the host 10-60 us, more than the kernel
(session 44 timed RoPE's 1,024-token launch at 7 us in graph replays and 17-93 us launched from
the host), so host-launched timings of a ~10 us GEMM measure the launcher, and they moved 2-4x
between runs (session 32). A graph's replays do not flush the L2 as `do_bench` does, so the
graph cycles through copies of the weights that together are twice the L2 (`weight_copies`):
each call reads its weights from memory, as a step reads each layer's, and its activations from
L2, as written by the kernel before it."""

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A GEMM as timed here: (activations, their scales, weights, their scales) -> output."""


def _fp8(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols, device=DEV) * 0.5).to(torch.float8_e4m3fn)


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def weight_copies(rows: int, cols: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Weights [rows, cols] and per-channel scales: one pair, or under GRAPHS as many copies as
    make twice the L2 (at least two), so that no graph replay finds its weights in L2."""
    count = 1
    if GRAPHS:
        l2_bytes = torch.cuda.get_device_properties(DEV).L2_cache_size
        count = max(2, math.ceil(2 * l2_bytes / (rows * cols)))
    return [(_fp8(rows, cols), torch.rand(1, rows, device=DEV) + 0.5) for _ in range(count)]


def gemm_us(
    gemm: Gemm, x: torch.Tensor, sx: torch.Tensor, copies: list, quick: bool = False
) -> float:
    """Microseconds of one `gemm` of `x` by a weight of `copies`: launched from the host on the
    first copy (`do_bench`, which flushes the L2 between calls), or under GRAPHS one graph
    replay of a call on each copy in turn, divided by the copies."""
    if not GRAPHS:
        w, sw = copies[0]
        run = functools.partial(gemm, x, sx, w, sw)
        return _us_quick(run) if quick else _us(run)

    def cycle() -> None:
        for w, sw in copies:
            gemm(x, sx, w, sw)

    ms = triton.testing.do_bench_cudagraph(cycle, rep=20 if quick else 100)
    return ms * 1e3 / len(copies)


def peak_tflops() -> float:
    """The roofline's GEMM peak: FP8 8192^3 with row-wise scales (flashrec_core/bench/roofline.py)."""
    m = 8192
    a, b = _fp8(m, m), _fp8(m, m).t()
    sa, sb = torch.ones(m, 1, device=DEV), torch.ones(1, m, device=DEV)
    us = _us(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return 2 * m**3 / us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("."))
    parser.add_argument("--graphs", action="store_true",
                        help="time replays of a CUDA graph over copies of the weights (GRAPHS)")  # fmt: skip
    args = parser.parse_args()
    global GRAPHS
    GRAPHS = args.graphs
    out, suffix = args.out, "_graphs" if GRAPHS else ""
    peak = peak_tflops()
    print(f"{torch.cuda.get_device_name()}: FP8 8192^3 peak {peak:.0f} TFLOP/s", flush=True)
    weights = {n: weight_copies(o, i) for n, (i, o) in PROJECTIONS.items()}
    rows_out = []
    for rows in ROWS:
        forward_us, flops = 0.0, 0.0
        row: dict[str, float] = {"rows": rows}
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            x = _fp8(rows, fan_in)
            sx = torch.rand(rows, 1, device=DEV) + 0.5
            us = gemm_us(_cublas, x, sx, weights[name])
            f = 2.0 * rows * fan_in * fan_out
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_tflops"] = round(f / us / 1e6, 1)
            forward_us += us * LAYERS
            flops += f * LAYERS
        row["forward_gemm_ms"] = round(forward_us / 1e3, 3)
        row["share_of_peak"] = round(flops / forward_us / 1e6 / peak, 3)
        row["us_per_row"] = round(forward_us / rows, 2)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    small: list[dict] = []

    def save() -> None:
        """The timings so far: a sweep cut short by the stage's time guard still leaves them."""
        (out / f"bench_gemm{suffix}.json").write_text(
            json.dumps(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "timer": "graph" if GRAPHS else "host launches",
                    "peak_tflops": peak,
                    "rows": rows_out,
                    "triton_small_m": small,
                },
                indent=1,
            )  # fmt: skip
        )

    save()
    for rows in TRITON_ROWS:
        small.append(triton_rows(rows, weights, rows_out))
        save()
    # the launch table flashrec_kernels reads for this GPU once copied to
    # flashrec_kernels/fp8_gemm_configs/<name>.json (docs/development.md, fp8_gemm_tables.py);
    # written only from every row count
    (out / f"fp8_gemm_tuned{suffix}.json").write_text(json.dumps(launch_table(small), indent=1))


TRITON_ROWS = (50, 150, 16, 512)
"""Row counts for the Triton small-row GEMM: one n=50 request's beam step, three, a few rows, and
one n=512 request (most telling first: a stage cut short by its time guard still printed them)."""
SWEEP = [
    dict(block_n=bn, block_k=bk, num_stages=st)
    for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 5)
]  # fmt: skip
"""Launch configurations tried beside the default (`launch_config`), with the default's row tile
(one tile up to 64 rows)."""
WIDE_ROWS_SWEEP = [
    dict(block_m=128, block_n=bn, block_k=128, num_stages=st) for bn in (16, 32) for st in (3, 4)
]  # fmt: skip
"""Tried as well from 128 rows on: one 128-row tile reads each weight tile once, where 64-row
tiles read it once per tile (from L2 at best). K steps of 128 only: at 256 a 128-row tile spills
~10 KB a thread (sm_90 compile, session 22)."""
SPLIT_SWEEP = [
    dict(block_n=bn, block_k=128, num_stages=st, split_k=sk)
    for bn in (16, 32) for st in (3, 4) for sk in (2, 4)
] + [
    dict(block_n=64, block_k=128, num_stages=4, split_k=2),
    dict(block_n=64, block_k=128, num_stages=4, split_k=4),
    dict(block_n=128, block_k=128, num_stages=3, split_k=4),
]  # fmt: skip
"""K splits (session 31): every GEMM of a few rows took 10 us or more whatever its bytes
(session 23), the latency of a program's dependent K steps; splits give each program fewer,
and a second kernel sums the partials. The wide column tiles with splits (session 44): every
program reads all its rows' activations over its K range, so narrow tiles read them N /
block_n times from L2 (the down projection at 50 rows and 16 columns a tile: 39 MB of L2 reads
for 12.6 MB of weights); 64 or 128 columns read them 4-8x less, and the splits keep a program
per SM. Eleven launches, so that the sweep still fits one stage with its compiles (each launch
compiles once per weight shape)."""
MAX_REL_DIFF = 0.02
"""A swept launch whose output differs from cuBLAS's by more than this (relative to the largest
magnitude; the default's is bf16 rounding, ~0.4%) is reported and not timed."""


def triton_rows(rows: int, weights: dict, cublas_rows: list[dict]) -> dict:
    """`flashrec_kernels.fp8_gemm` at `rows` against `torch._scaled_mm`: each projection with the
    default launch and the fastest of SWEEP (its output checked against cuBLAS's first), and the
    forward's GEMM time with the faster of the two per projection."""
    from dataclasses import asdict

    from flashrec_kernels import fp8_gemm
    from flashrec_kernels.fp8_gemm_tables import config_file, tuned_table
    from flashrec_kernels.triton_fp8_gemm import launch_config

    props = torch.cuda.get_device_properties(DEV)
    table = tuned_table(config_file(props.name))
    cublas = next((r for r in cublas_rows if r["rows"] == rows), None)
    row: dict = {"rows": rows}
    forward_best_us = 0.0
    for name, (fan_in, fan_out) in PROJECTIONS.items():
        default = asdict(launch_config(rows, fan_out, fan_in, props.multi_processor_count, table))
        x = _fp8(rows, fan_in)
        sx = torch.rand(rows, device=DEV) + 0.5
        copies = [(w, sw.view(-1)) for w, sw in weights[name]]
        w, sw = copies[0]
        ref = _cublas(x, sx, w, sw).float()
        got = fp8_gemm(x, sx, w, sw).float()
        rel = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
        default_us = gemm_us(fp8_gemm, x, sx, copies, quick=True)
        best_us, best_cfg = default_us, default
        for cfg in SWEEP + SPLIT_SWEEP + (WIDE_ROWS_SWEEP if rows >= 128 else []):
            try:
                swept = fp8_gemm(x, sx, w, sw, **cfg).float()
                diff = ((swept - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                if diff > MAX_REL_DIFF:
                    print(f"  {name} {cfg}: output off cuBLAS's by {diff:.3g}", flush=True)
                    continue
                us = gemm_us(functools.partial(fp8_gemm, **cfg), x, sx, copies, quick=True)
            except Exception as exc:  # a configuration that does not build here (resources)
                print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
                continue
            if us < best_us:
                best_us, best_cfg = us, {**default, **cfg}
        # The quick timings pick the best; the default and the best are timed again at length,
        # alternating, each keeping its faster run: session 32's sweep timed some launches at
        # 2-4x session 23's for the same code, and one quick run should not write the table.
        for _ in range(2):
            default_us = min(default_us, gemm_us(fp8_gemm, x, sx, copies))
            best_us = min(best_us, gemm_us(functools.partial(fp8_gemm, **best_cfg), x, sx, copies))
        if default_us <= best_us:  # timed at length, the sweep's pick did not beat the default
            best_us, best_cfg = default_us, default
        cublas_us = cublas[f"{name}_us"] if cublas else gemm_us(_cublas, x, sx, copies, quick=True)
        row[name] = {"cublas_us": round(cublas_us, 2), "triton_default_us": round(default_us, 2),
                     "triton_default": default, "triton_best_us": round(best_us, 2),
                     "triton_best": best_cfg, "shape": f"N={fan_out},K={fan_in}",
                     "max_rel_diff_vs_cublas": rel}  # fmt: skip
        forward_best_us += min(cublas_us, best_us) * LAYERS
    row["forward_gemm_best_ms"] = round(forward_best_us / 1e3, 3)
    print(json.dumps(row), flush=True)
    return row


def launch_table(small: list[dict]) -> dict[str, dict]:
    """Each projection's fastest launch at each row count timed, and `max_rows`: the largest
    row count up to which the kernel beat cuBLAS at every count timed (0: not at the smallest)."""
    from flashrec_kernels.fp8_gemm_tables import faster_up_to

    table: dict[str, dict] = {}
    for name in PROJECTIONS:
        timings = [(r["rows"], r[name]["triton_best_us"], r[name]["cublas_us"]) for r in small]
        table[small[0][name]["shape"]] = {
            "max_rows": faster_up_to(timings),
            "launches": {str(r["rows"]): r[name]["triton_best"] for r in small},
        }
    return table


def _cublas(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """A projection exactly as the engine runs it above the small-row limit: `fp8_linear`, which
    calls `torch._scaled_mm` with per-token and per-channel scales."""
    from flashrec_core.layers.quant import QuantizedActivation, fp8_linear

    return fp8_linear(QuantizedActivation(x, sx.view(-1, 1)), w, sw.view(-1), None, torch.bfloat16)


def _us_quick(fn) -> float:
    """A shorter `_us` for the sweep (each call is ~10 us; 20 ms still averages ~1,000 runs)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3


if __name__ == "__main__":
    main()
