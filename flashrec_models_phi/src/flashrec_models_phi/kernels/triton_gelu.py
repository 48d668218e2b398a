"""Triton kernel of `gelu_tanh_quant_fp8`: one program per token row, in two passes over chunks.

Intermediate sizes run to ~10k-30k, too wide to hold a row in registers, so pass 1 finds the
row's absmax and pass 2 recomputes GELU (the row is still in L2) and stores the codes, the layout
of the shared SiLU*mul kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrec_kernels.triton_fp8 import fp8_scale, to_fp8
from flashrec_kernels.triton_quant import empty_fp8_rows

from .gelu import GELU_CUBIC, SQRT_2_OVER_PI

__all__ = ["launch_gelu_tanh_quant_fp8"]

_CHUNK = 1024
_SQRT_2_OVER_PI = tl.constexpr(SQRT_2_OVER_PI)
_GELU_CUBIC = tl.constexpr(GELU_CUBIC)


@triton.jit
def _gelu_tanh(row_ptr, offs, mask):
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)
    # Plain `/` (approximate on GPU): tl.exp is approximate there anyway, as in SiLU*mul.
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _gelu_tanh_quant_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, row_stride, INTER: tl.constexpr, CHUNK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * row_stride
    absmax = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, INTER, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        y = _gelu_tanh(row_ptr, offs, offs < INTER)
        absmax = tl.maximum(absmax, tl.abs(y))  # masked lanes hold gelu(0) = 0
    scale = fp8_scale(tl.max(absmax, axis=0))
    for start in range(0, INTER, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < INTER
        y = _gelu_tanh(row_ptr, offs, mask)
        tl.store(q_ptr + row * INTER + offs, to_fp8(y, scale), mask=mask)
    tl.store(scale_ptr + row, scale)


def launch_gelu_tanh_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per row; arguments are validated by the public wrapper."""
    t, inter = x.shape
    q, scale = empty_fp8_rows(t, inter, x.device)
    if t == 0 or inter == 0:
        return q, scale
    chunk = min(_CHUNK, triton.next_power_of_2(inter))
    _gelu_tanh_quant_fp8_kernel[(t,)](
        x, q, scale, x.stride(0), INTER=inter, CHUNK=chunk, num_warps=4
    )
    return q, scale
