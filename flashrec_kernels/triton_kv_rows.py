"""Triton kernel of `copy_kv_rows`: one program per block of rows, K and V of all heads."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .triton_fp8 import cast_for_store

__all__ = ["launch_copy_kv_rows"]

ROWS_PER_PROGRAM = 4
"""Rows a program copies: 4 x 8 heads x 128 dims of K and of V (the bench preset's layer) is 8 KB
of loads in flight per program, and a prefill's few hundred context rows still fill the GPU."""


@triton.jit
def _copy_rows(src, dst, slot, row, mask, s_stride_s, s_stride_h, d_stride_s, d_stride_h,
               H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """[R] slots of src -> [R] rows of dst, [R, BLOCK_H, BLOCK_D] at once, in dst's dtype."""
    offs_h = tl.arange(0, BLOCK_H)[None, :, None]
    offs_d = tl.arange(0, BLOCK_D)[None, None, :]
    m = mask[:, None, None] & (offs_h < H) & (offs_d < D)
    src_ptrs = src + slot[:, None, None] * s_stride_s + offs_h * s_stride_h + offs_d
    # fp32 in between: the interpreter casts to bf16 by truncation (exact here either way)
    x = tl.load(src_ptrs, mask=m, other=0.0).to(tl.float32)
    dst_ptrs = dst + row[:, None, None] * d_stride_s + offs_h * d_stride_h + offs_d
    tl.store(dst_ptrs, cast_for_store(x, dst.dtype.element_ty), mask=m)


@triton.jit
def _copy_kv_rows_kernel(
    k_src, v_src, slots, k_dst, v_dst, rows, n, count,
    ks_s, ks_h, vs_s, vs_h, kd_s, kd_h, vd_s, vd_h, slot_stride, row_stride,
    H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_COUNT: tl.constexpr, HAS_SLOTS: tl.constexpr,
):  # fmt: skip
    """Rows [0, n) of the launch, or only [0, count[0]) with a count (rows past it: no-ops);
    without slots, source row i for destination row rows[i]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_COUNT:
        mask = offs < tl.minimum(tl.load(count).to(tl.int64), n)
    else:
        mask = offs < n
    if HAS_SLOTS:
        slot = tl.load(slots + offs * slot_stride, mask=mask, other=0).to(tl.int64)
    else:
        slot = offs
    row = tl.load(rows + offs * row_stride, mask=mask, other=0).to(tl.int64)
    _copy_rows(k_src, k_dst, slot, row, mask, ks_s, ks_h, kd_s, kd_h, H, D, BLOCK_H, BLOCK_D)
    _copy_rows(v_src, v_dst, slot, row, mask, vs_s, vs_h, vd_s, vd_h, H, D, BLOCK_H, BLOCK_D)


def launch_copy_kv_rows(
    k_src: Tensor, v_src: Tensor, slots: Tensor | None, k_dst: Tensor, v_dst: Tensor, rows: Tensor,
    count: Tensor | None = None,
) -> None:  # fmt: skip
    """Launch over the rows; arguments are validated by the public wrapper."""
    n = rows.numel()
    if n == 0:
        return
    heads, dim = k_src.shape[1:]
    slots_or_rows = rows if slots is None else slots  # never read without slots
    _copy_kv_rows_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        k_src, v_src, slots_or_rows, k_dst, v_dst, rows, n, rows if count is None else count,
        k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        slots_or_rows.stride(0), rows.stride(0),
        H=heads, D=dim, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim), HAS_COUNT=count is not None,
        HAS_SLOTS=slots is not None, num_warps=4,
    )  # fmt: skip
