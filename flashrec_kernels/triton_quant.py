"""Triton per-token FP8 quantization, plus the row launch shape the fused row kernels share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE
from .triton_fp8 import quantize_row_fp8

__all__ = ["empty_fp8_rows", "launch_per_token_quant_fp8", "row_launch_config"]


def row_launch_config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one-program-per-row kernels: the whole row sits in registers."""
    block = triton.next_power_of_2(max(n, 1))
    num_warps = min(max(block // 256, 1), 16)  # ~8 fp32 per thread up to 4096, then more
    return block, num_warps


def empty_fp8_rows(t: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers of the per-token FP8 format: codes [T, N] and scales [T, 1]."""
    q = torch.empty((t, n), dtype=FP8_DTYPE, device=device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=device)
    return q, scale


@triton.jit
def _per_token_quant_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, x_row_stride, N: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # Load, then fp32 before any arithmetic (the interpreter computes bf16 arithmetic wrongly).
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    quantize_row_fp8(x, mask, q_ptr + row * N + offs, scale_ptr + row)


def launch_per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per row; arguments are validated by the public wrapper."""
    t, n = x.shape
    q, scale = empty_fp8_rows(t, n, x.device)
    if t == 0:
        return q, scale
    block, num_warps = row_launch_config(n)
    _per_token_quant_fp8_kernel[(t,)](x, q, scale, x.stride(0), n, BLOCK=block, num_warps=num_warps)
    return q, scale
