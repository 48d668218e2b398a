"""Triton kernel of the gated activations -> FP8 (`silu_mul_quant_fp8`, `gelu_tanh_mul_quant_fp8`):
one program per token row, in two passes over chunks; ACT picks the activation of the gate.

Intermediate sizes run to ~30k, too wide to hold a row in registers, so pass 1 finds the row's
absmax and pass 2 recomputes silu * up (the row is still in L2) and stores the codes. On an H200
this is about 1.6x faster than a whole-row block at I = 12288. Chunks of 2048 at 8 warps were
the fastest that scripts/bench_elementwise.py found on an H100 at the bench preset's
intermediate size (6144): 26 / 119 us for 1,024 / 8,184 rows, against 31 / 162 us with chunks
of 1024 and 4 warps (docs/benchmarks.md, session 19); a one-pass form with the row in registers
was slower at 8,184 rows. That kernel was bound by instruction issue; with the GPU-side
arithmetic of session 40 (hardware FP8 rounding, `div_rn_by`, ex2 / rcp gates) it took 20 / 95
us, 90-95% of the copy bandwidth. Session 43's sweep on an H100 moved the default to 16 warps
with the L2 hints (`cache_hints`): 18.5 / 91.0 us against 20.4 / 94.7, at the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .silu_mul import GELU_CUBIC, SQRT_2_OVER_PI
from .triton_fp8 import INTERPRETED, fp8_scale, to_fp8
from .triton_quant import empty_fp8_rows

__all__ = ["ACT_GELU_TANH", "ACT_SILU", "launch_silu_mul_quant_fp8"]

_CHUNK = 2048
_NUM_WARPS = 16
ACT_SILU = 0
ACT_GELU_TANH = 1
_SQRT_2_OVER_PI = tl.constexpr(SQRT_2_OVER_PI)
_GELU_CUBIC = tl.constexpr(GELU_CUBIC)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2_ftz(x):
    return tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _rcp_ftz(x):
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _gate_by(gate, neg_log2):
    """gate / (1 + 2^neg_log2): the logistic gate of SiLU (neg_log2 = -gate log2 e) and of
    GELU(tanh). On a GPU one ex2 and one reciprocal, flushing denormals, where tl.exp and `/`
    compile to the same two plus seven instructions guarding denormal and huge arguments (the
    kernel's SASS for sm_90): within the tests' tolerance either way (an fp32 ulp or two), and
    the same at the extremes (2^big = inf gives -0, 2^-big = 0 gives gate). The interpreter has
    no inline PTX."""
    if INTERPRETED:
        return gate / (1.0 + tl.exp2(neg_log2))
    return gate * _rcp_ftz(1.0 + _exp2_ftz(neg_log2))


@triton.jit
def _silu_mul(row_ptr, offs, mask, INTER: tl.constexpr, ACT: tl.constexpr,
              EVICT: tl.constexpr):  # fmt: skip
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    gate = tl.load(row_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    up = tl.load(row_ptr + INTER + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    up = up.to(tl.float32)
    # Approximate exp and division on GPU: IEEE division would buy no exactness after an
    # approximate exp, and it cost ~15% here.
    if ACT == 1:
        # GELU(tanh) as x / (1 + exp(-2u)) = 0.5 x (1 + tanh(u)): Triton has no tanh that the
        # interpreter runs, and this form cannot overflow to NaN.
        u = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        return _gate_by(gate, u * (-2.0 * _LOG2E)) * up
    return _gate_by(gate, gate * -_LOG2E) * up


@triton.jit
def _silu_mul_quant_fp8_kernel(
    gate_up_ptr, q_ptr, scale_ptr, row_stride, INTER: tl.constexpr, CHUNK: tl.constexpr,
    ACT: tl.constexpr, FIRST_EVICT: tl.constexpr, SECOND_EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):  # fmt: skip
    """FIRST_EVICT / SECOND_EVICT: the L2 eviction policy of each pass's loads, STORE_CACHE the
    codes' cache modifier ("" for the defaults; `launch_silu_mul_quant_fp8(cache_hints=True)`)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = gate_up_ptr + row * row_stride
    absmax = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, INTER, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        y = _silu_mul(row_ptr, offs, offs < INTER, INTER, ACT, FIRST_EVICT)
        absmax = tl.maximum(absmax, tl.abs(y))  # masked lanes hold silu(0) * 0 = 0
    scale = fp8_scale(tl.max(absmax, axis=0))
    for start in range(0, INTER, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < INTER
        y = _silu_mul(row_ptr, offs, mask, INTER, ACT, SECOND_EVICT)
        tl.store(q_ptr + row * INTER + offs, to_fp8(y, scale), mask=mask,
                 cache_modifier=STORE_CACHE)  # fmt: skip
    tl.store(scale_ptr + row, scale)


def launch_silu_mul_quant_fp8(
    gate_up: torch.Tensor,
    act: int = ACT_SILU,
    chunk: int = _CHUNK,
    num_warps: int = _NUM_WARPS,
    cache_hints: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per row; arguments are validated by the public wrapper. `chunk`,
    `num_warps` and `cache_hints` (L2 eviction hints: they change no value) are the launch
    configuration (scripts/bench_elementwise.py tries others)."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    q, scale = empty_fp8_rows(t, inter, gate_up.device)
    if t == 0 or inter == 0:
        return q, scale
    chunk = min(chunk, triton.next_power_of_2(inter))
    _silu_mul_quant_fp8_kernel[(t,)](
        gate_up, q, scale, gate_up.stride(0), INTER=inter, CHUNK=chunk, ACT=act,
        # with hints, pass 1's loads keep the row in L2 for pass 2, pass 2's let it go, and
        # the codes (read only by the next GEMM) stream past L2
        FIRST_EVICT="evict_last" if cache_hints else "",
        SECOND_EVICT="evict_first" if cache_hints else "",
        STORE_CACHE=".cs" if cache_hints else "", num_warps=num_warps,
    )  # fmt: skip
    return q, scale
