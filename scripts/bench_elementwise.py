"""The fused elementwise kernels alone, against their bandwidth floor, under several launch
configurations: SiLU-mul -> FP8 (`launch_silu_mul_quant_fp8`), RMSNorm (+ residual) -> FP8
(`launch_rms_norm_quant_fp8`) and q/k RMSNorm + RoPE + KV-cache store
(`launch_rope_norm_store`, tokens per program x warps), at the bench preset's shapes
(Qwen3-1.7B: hidden 2048, intermediate 6144, 16 q / 8 KV heads of 128) for one request's
prefill (1,024 tokens), a full prefill chunk (8,184) and a beam step of 8,192 rows.

The last profile of one unloaded n=50 request put SiLU-mul at 1.08 ms and RMSNorm at 0.74 ms of
its 11.3 ms of GPU time, several times what their bytes need at the card's copy bandwidth: this
script says how far each configuration is from that floor, so the default can follow the
fastest (session 19's run on an H100 set SiLU-mul's and RoPE's: docs/benchmarks.md). Every
variant's output is checked against the default's before it is timed: SiLU-mul's codes must be
equal (a configuration changes only how a row is split among threads; absmax is order-free),
RMSNorm's and RoPE's within the tolerance of their tests (a sum of squares reduced in another
order). Times are CUDA events (`triton.testing.do_bench`; with --graphs, replays of a CUDA graph
of the launch, `do_bench_cudagraph`, into bench_elementwise_graphs.json). With --defaults only
each kernel's default launch is timed: an A/B of two kernel trees (gpu_run.sh's KERNELS_BASE runs
it on both). Session 43 found RoPE's 1,024-token launches taking 14 us in one process and 30-56
us in another; a graph's replays take the host's launches out of that measurement.
Usage (on the GPU):
    python scripts/bench_elementwise.py [OUT_DIR] [--defaults] [--graphs]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton.testing

from flashrec_kernels import (
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
    rms_norm_quant_fp8_ref,
    silu_mul_quant_fp8_ref,
)
from flashrec_kernels.testing import assert_fp8_close, assert_ulp_close
from flashrec_kernels.triton_rms_norm import launch_rms_norm_quant_fp8
from flashrec_kernels.triton_rope import launch_rope_norm_store
from flashrec_kernels.triton_silu_mul import launch_silu_mul_quant_fp8

HIDDEN, INTER = 2048, 6144
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
TOKENS = (1024, 8184, 8192)
DEV = torch.device("cuda")


GRAPHS = False
"""--graphs: time each launch replayed in a CUDA graph (`do_bench_cudagraph`), as the engine's
prefill and step graphs run it: no host launch between replays, and no L2 flush either (a
1,024-token working set stays in the L2 across replays; the copy it is compared with too)."""


def _ms(fn) -> float:
    if GRAPHS:
        return triton.testing.do_bench_cudagraph(fn, rep=200)
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def _copy_gbps(nbytes: int) -> float:
    """The card's device-to-device copy bandwidth for a copy that moves `nbytes` in all (half
    read, half written), the same traffic as the kernel it is compared with."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    return 4 * src.numel() / _ms(lambda: dst.copy_(src)) / 1e6


def _row(kernel: str, tokens: int, config: dict, ms: float, nbytes: int, floor_gbps: float):
    gbps = nbytes / ms / 1e6
    row = {"kernel": kernel, "tokens": tokens, **config, **({"timer": "graph"} if GRAPHS else {}),
           "us": round(ms * 1e3, 2),
           "gb_per_s": round(gbps), "share_of_copy_bandwidth": round(gbps / floor_gbps, 3)}  # fmt: skip
    print(json.dumps(row))
    return row


def check_against_reference(tokens: int) -> list[str]:
    """The default launches against the torch references at the bench's shapes, with the
    tolerances of tests/kernels (test_silu_mul_fp8.py, test_rms_norm_fp8.py: an approximate exp,
    a reduction order) and exactly for the plain quantizer (IEEE division, one rounding). Returns
    what disagreed (printed, not fatal: a base tree of an A/B is timed either way)."""
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    gate_up = torch.randn(tokens, 2 * INTER, generator=gen, device=DEV).to(torch.bfloat16) * 3
    x = torch.randn(tokens, HIDDEN, generator=gen, device=DEV).to(torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(HIDDEN, generator=gen, device=DEV).to(torch.bfloat16) + 0.5
    h = torch.randn(tokens, INTER, generator=gen, device=DEV) * 5
    failures = []

    def check(name: str, fn) -> None:
        try:
            fn()
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0] if str(e) else 'differs'}")

    def silu() -> None:
        q, scale = launch_silu_mul_quant_fp8(gate_up)
        assert_fp8_close(q, scale, *silu_mul_quant_fp8_ref(gate_up), scale_max_ulp=4, max_ulp=1,
                         max_frac=0.01)  # fmt: skip

    def rms() -> None:
        q, scale, res_out = launch_rms_norm_quant_fp8(x, w, 1e-6, res)
        q_ref, scale_ref, res_ref = rms_norm_quant_fp8_ref(x, w, 1e-6, res)
        assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=6, max_ulp=1, max_frac=0.01)
        assert torch.equal(res_out, res_ref), "residual sum"

    def quant() -> None:
        q, scale = per_token_quant_fp8(h)
        q_ref, scale_ref = per_token_quant_fp8_ref(h)
        assert torch.equal(scale, scale_ref), "scales"
        differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
        assert not bool(differ.any()), f"{int(differ.sum())} of {q.numel()} codes differ"

    for name, fn in (("SiLU-mul", silu), ("RMSNorm", rms), ("quantizer", quant)):
        check(name, fn)
    print(f"{tokens} tokens, against the references: " + ("; ".join(failures) or "all agree"))
    return failures


def silu_mul(tokens: int, sweep: bool = True) -> list[dict]:
    gate_up = torch.randn(tokens, 2 * INTER, dtype=torch.bfloat16, device=DEV)
    nbytes = gate_up.numel() * 2 + tokens * INTER + tokens * 4  # bf16 in, fp8 out, fp32 scales
    floor = _copy_gbps(nbytes)
    want = launch_silu_mul_quant_fp8(gate_up)
    rows = []
    configs = [{"chunk": c, "num_warps": w} for c, w in itertools.product((1024, 2048, 4096),
                                                                         (4, 8, 16))]  # fmt: skip
    # L2 eviction hints (keep the row for pass 2, stream the codes) on the fastest launches
    configs += [{"chunk": c, "num_warps": w, "cache_hints": True}
                for c, w in ((2048, 8), (2048, 16), (4096, 16))]  # fmt: skip
    if not sweep:
        configs = [{}]
    for config in configs:
        got = launch_silu_mul_quant_fp8(gate_up, **config)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), config
        assert torch.equal(got[1], want[1]), config
        ms = _ms(lambda c=config: launch_silu_mul_quant_fp8(gate_up, **c))
        rows.append(_row("silu_mul_fp8", tokens, config, ms, nbytes, floor))
    return rows


def rms_norm(tokens: int, sweep: bool = True) -> list[dict]:
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=DEV)
    res = torch.randn_like(x)
    w = torch.rand(HIDDEN, dtype=torch.bfloat16, device=DEV) + 0.5
    # x and residual in, the summed residual out (bf16), FP8 codes and fp32 scales out
    nbytes = 3 * x.numel() * 2 + x.numel() + tokens * 4
    floor = _copy_gbps(nbytes)
    want = launch_rms_norm_quant_fp8(x, w, 1e-6, res)
    rows = []
    for warps in (2, 4, 8, 16) if sweep else (None,):
        got = launch_rms_norm_quant_fp8(x, w, 1e-6, res, num_warps=warps)
        # the tolerance of tests/kernels/test_rms_norm_fp8.py (SCALE_ULP, CODE_TOL), whose
        # comment derives it from the reduction order
        assert_fp8_close(got[0], got[1], want[0], want[1], scale_max_ulp=6, max_ulp=1,
                         max_frac=0.01)  # fmt: skip
        assert torch.equal(got[2], want[2]), "the residual sum does not depend on the launch"
        ms = _ms(lambda nw=warps: launch_rms_norm_quant_fp8(x, w, 1e-6, res, num_warps=nw))
        rows.append(_row("rms_norm_fp8", tokens, {"num_warps": warps}, ms, nbytes, floor))
    return rows


def _rope_inputs(tokens: int, seed: int = 0) -> tuple:
    """A fused qkv buffer's views, positions, cos/sin and FP8 caches at the preset's shapes (a
    fresh copy each call: the kernel rotates q and k in place)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen, device=DEV)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    views = [t.view(tokens, -1, HEAD_DIM) for t in (q, k, v)]
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEV)
    inv_freq = 1e6 ** (-torch.arange(0, HEAD_DIM, 2, device=DEV, dtype=torch.float64) / HEAD_DIM)
    freqs = torch.arange(4096, device=DEV, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
    slots = tokens + 64
    caches = torch.zeros(2, slots, KV_HEADS, HEAD_DIM, device=DEV).to(torch.float8_e4m3fn)
    out_loc = torch.randperm(slots, generator=gen, device=DEV)[:tokens]
    weights = tuple(
        (torch.rand(HEAD_DIM, generator=gen, device=DEV) + 0.5).to(torch.bfloat16) for _ in "qk"
    )
    return qkv, views, positions, cos_sin, caches, out_loc, weights


def rope(tokens: int, sweep: bool = True) -> list[dict]:
    """q/k RMSNorm + RoPE in place, K and V into FP8 caches (`launch_rope_norm_store`)."""
    per_token = (2 * (Q_HEADS + KV_HEADS) * 2 + KV_HEADS * 2 + 2 * KV_HEADS) * HEAD_DIM + 16
    nbytes = tokens * per_token  # q, k read and written (bf16), v read, k, v cached (fp8), ids
    floor = _copy_gbps(nbytes)

    def run(inputs: tuple, **config) -> None:
        _, (q, k, v), positions, cos_sin, caches, out_loc, weights = inputs
        launch_rope_norm_store(
            q, k, v, positions, cos_sin, caches[0], caches[1], out_loc, weights, 1e-6, HEAD_DIM,
            **config,
        )  # fmt: skip

    want = _rope_inputs(tokens)
    run(want)
    rows = []
    launches = itertools.product((1, 2, 4, 8), (4, 8, 16)) if sweep else [(None, None)]
    for per_program, warps in launches:
        config = {"tokens_per_program": per_program, "num_warps": warps}
        got = _rope_inputs(tokens)
        run(got, **config)
        # the tolerance of tests/kernels/test_rope_norm_store.py: the norm's sum may be reduced
        # in another order (one bf16 rounding apart, or tiny where the rotation cancels)
        torch.testing.assert_close(got[0], want[0], rtol=2**-7, atol=2**-18)
        assert_ulp_close(got[4][0], want[4][0], max_ulp=1, max_frac=0.01)
        assert torch.equal(got[4][1].view(torch.uint8), want[4][1].view(torch.uint8)), config
        ms = _ms(lambda c=config, g=got: run(g, **c))
        rows.append(_row("rope_norm_store", tokens, config, ms, nbytes, floor))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("."))
    parser.add_argument("--defaults", action="store_true", help="time each default launch only")
    parser.add_argument("--graphs", action="store_true",
                        help="time replays of a CUDA graph of each launch (GRAPHS)")  # fmt: skip
    args = parser.parse_args()
    global GRAPHS
    GRAPHS = args.graphs
    out, sweep = args.out, not args.defaults
    rows = []
    for tokens in TOKENS:
        disagreements = check_against_reference(tokens)
        rows += [{"tokens": tokens, "disagreements_with_references": disagreements}]
        rows += silu_mul(tokens, sweep) + rms_norm(tokens, sweep) + rope(tokens, sweep)
    name = "bench_elementwise_graphs.json" if GRAPHS else "bench_elementwise.json"
    (out / name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
