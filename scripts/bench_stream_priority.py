"""Would a beam step on a high-priority CUDA stream stop waiting behind a prefill?

The latency tail under load (docs/architecture.md) is beam steps queued behind other requests'
prefills. Before the engine loop is rebuilt around two streams, this measures the premise on
the GPU with the engine's own GEMM path: two CUDA graphs of a synthetic Qwen3-1.7B-shape stack
(28 layers of the four FP8 projections through `fp8_linear`, with the small-row Triton GEMM where
this GPU's launch table takes it, per-token quantization and torch RMSNorm / SiLU-mul / residual
kernels; attention left out), a "prefill" of T tokens and a "step" of R rows. It reports, with
CUDA events:

- each graph alone;
- a step queued on the prefill's stream (today's loop): its completion after the prefill's start;
- a step launched ~1 ms into a running prefill on a second stream of the same priority, and of a
  higher priority: the step's own latency and the prefill's;
- a stream of back-to-back prefills with a step every ~3 ms on the high-priority stream against
  the same work on one stream: whether overlapping them costs or saves GPU time in total.

Usage (on the GPU): python scripts/bench_stream_priority.py [OUT_DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

HIDDEN, INTER, LAYERS = 2048, 6144, 28
QKV = (16 + 2 * 8) * 128
DEV = torch.device("cuda")
PREFILL_TOKENS = (1024, 2048)
STEP_ROWS = (100, 200, 400)
TRIALS = 30


def _weights() -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gu": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}  # fmt: skip
    return [
        {
            k: (
                (torch.randn(o, i, device=DEV) * 0.05).to(torch.float8_e4m3fn),
                torch.rand(o, device=DEV) + 0.5,
            )
            for k, (o, i) in shapes.items()
        }  # fmt: skip
        for _ in range(LAYERS)
    ]


def _forward(x: torch.Tensor, weights: list, small_rows: dict[str, int]) -> torch.Tensor:
    from flashrec_core.layers.quant import fp8_linear, quantize_per_token

    def linear(h: torch.Tensor, name: str, layer: dict) -> torch.Tensor:
        w, s = layer[name]
        q = quantize_per_token(h, triton=True)
        return fp8_linear(q, w, s, None, torch.bfloat16, small_rows[name])

    def norm(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    for layer in weights:
        qkv = linear(norm(x), "qkv", layer)
        x = x + linear(qkv[:, :HIDDEN].contiguous(), "o", layer)
        gate, up = linear(norm(x), "gu", layer).chunk(2, dim=-1)
        x = x + linear(torch.nn.functional.silu(gate) * up, "down", layer)
    return x


def _graph(rows: int, weights: list, small_rows: dict[str, int]) -> torch.cuda.CUDAGraph:
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _forward(x, weights, small_rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _forward(x, weights, small_rows)
    return graph


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=100)


def _pair(prefill: torch.cuda.CUDAGraph, step: torch.cuda.CUDAGraph, lo: torch.cuda.Stream,
          hi: torch.cuda.Stream | None) -> tuple[float, float]:  # fmt: skip
    """One prefill on `lo` and one step ~1 ms later on `hi` (None: queued after it on `lo`).
    Returns (the step's latency from its launch point, the prefill's duration)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    with torch.cuda.stream(lo):
        ev[0].record()
        prefill.replay()
        ev[1].record()
    step_stream = hi if hi is not None else lo
    with torch.cuda.stream(step_stream):
        if hi is not None:
            torch.cuda._sleep(1_500_000)  # ~1 ms at 1.5-2 GHz: the step arrives mid-prefill
            ev[2].record()
        else:
            ev[2] = ev[0]
        step.replay()
        ev[3].record()
    torch.cuda.synchronize()
    if hi is None:  # launched at the same point as on two streams: 1 ms after the start
        return ev[0].elapsed_time(ev[3]) - 1.0, ev[0].elapsed_time(ev[1])
    return ev[2].elapsed_time(ev[3]), ev[0].elapsed_time(ev[1])


def _stream_run(prefill: torch.cuda.CUDAGraph, step: torch.cuda.CUDAGraph, lo: torch.cuda.Stream,
                hi: torch.cuda.Stream | None, prefills: int = 8) -> dict[str, float]:  # fmt: skip
    """`prefills` prefills back to back on `lo`, and on `hi` a step every ~3 ms (a sleep, then
    the step; None: the steps interleaved on `lo` after every prefill, as the loop does today).
    Returns the total span, and the steps' mean / max latency from their launch point."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    marks = []
    torch.cuda.synchronize()
    with torch.cuda.stream(lo):
        start.record()
    if hi is None:
        with torch.cuda.stream(lo):
            for _ in range(prefills):
                prefill.replay()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step.replay()
                b.record()
                marks.append((a, b))
            end.record()
    else:
        hi.wait_stream(lo)
        with torch.cuda.stream(lo):
            for _ in range(prefills):
                prefill.replay()
        with torch.cuda.stream(hi):
            for _ in range(prefills):
                torch.cuda._sleep(4_000_000)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step.replay()
                b.record()
                marks.append((a, b))
        lo.wait_stream(hi)
        with torch.cuda.stream(lo):
            end.record()
    torch.cuda.synchronize()
    lat = [a.elapsed_time(b) for a, b in marks]
    return {"span_ms": round(start.elapsed_time(end), 3),
            "step_mean_ms": round(statistics.mean(lat), 3), "step_max_ms": round(max(lat), 3)}  # fmt: skip


def main() -> None:
    from flashrec_kernels import fp8_gemm_rows

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    lowest, highest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a staticmethod
    print(f"{torch.cuda.get_device_name()}: stream priorities {lowest}..{highest}", flush=True)
    weights = _weights()
    small_rows = {k: fp8_gemm_rows(o, i, DEV) for k, (o, i) in
                  {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gu": (2 * INTER, HIDDEN),
                   "down": (HIDDEN, INTER)}.items()}  # fmt: skip
    print(f"small-row Triton GEMM up to {small_rows} rows", flush=True)
    lo = torch.cuda.Stream(priority=lowest)
    same = torch.cuda.Stream(priority=lowest)
    hi = torch.cuda.Stream(priority=highest)
    results = []
    for tokens in PREFILL_TOKENS:
        prefill = _graph(tokens, weights, small_rows)
        prefill_ms = _ms(prefill.replay)
        for rows in STEP_ROWS:
            step = _graph(rows, weights, small_rows)
            row: dict = {"prefill_tokens": tokens, "step_rows": rows,
                         "prefill_alone_ms": round(prefill_ms, 3),
                         "step_alone_ms": round(_ms(step.replay), 3)}  # fmt: skip
            for name, stream in (("one_stream", None), ("same_priority", same), ("high", hi)):
                pairs = [_pair(prefill, step, lo, stream) for _ in range(TRIALS)]
                steps = sorted(p[0] for p in pairs)
                row[f"{name}_step_p50_ms"] = round(steps[len(steps) // 2], 3)
                row[f"{name}_step_max_ms"] = round(steps[-1], 3)
                row[f"{name}_prefill_p50_ms"] = round(statistics.median(p[1] for p in pairs), 3)
            for name, stream in (("serial", None), ("overlap_high", hi)):
                row[f"run_{name}"] = _stream_run(prefill, step, lo, stream)
            print(json.dumps(row), flush=True)
            results.append(row)
            del step
    (out / "bench_stream_priority.json").write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}, indent=1)
    )


if __name__ == "__main__":
    main()
