"""Triton kernel of `rms_norm_quant_fp8`: one program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import cast_for_store, quantize_row_fp8
from .triton_quant import empty_fp8_rows, row_launch_config

__all__ = ["launch_rms_norm_quant_fp8"]


@triton.jit
def _rms_norm_quant_fp8_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    q_ptr,
    scale_ptr,
    res_out_ptr,
    x_row_stride,
    res_row_stride,
    eps,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    h = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        stored = cast_for_store(h + r, res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, stored, mask=mask)
        h = stored.to(tl.float32)  # normalize the residual as stored, like the unfused path
    mean_sq = tl.math.div_rn(tl.sum(h * h, axis=0), N * 1.0)
    # sqrt_rn/div_rn: the approximate GPU rsqrt would drift from the reference by ulps.
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    quantize_row_fp8(h * inv_rms * w, mask, q_ptr + row * N + offs, scale_ptr + row)


def launch_rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch one program per row; arguments are validated by the public wrapper. `num_warps`
    overrides the row's default (scripts/bench_elementwise.py tries others)."""
    t, n = x.shape
    q, scale = empty_fp8_rows(t, n, x.device)
    res_out = None if residual is None else torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return q, scale, res_out
    block, default_warps = row_launch_config(n)
    num_warps = num_warps or default_warps
    # Without a residual the residual pointers are never read; x stands in for them.
    res_in = x if residual is None else residual
    _rms_norm_quant_fp8_kernel[(t,)](
        x,
        res_in,
        weight,
        q,
        scale,
        x if res_out is None else res_out,
        x.stride(0),
        res_in.stride(0),
        eps,
        N=n,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return q, scale, res_out
