"""Triton kernel of `rope_norm_store`: one program per (token, head) over Hq + Hkv heads.

Programs with head < Hq rotate a q head in place; the others rotate a k head in place and store it
and the matching v head into the caches at out_loc. All offsets are explicit strides, so q/k/v can
be zero-copy views of the fused qkv buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import cast_for_store

__all__ = ["launch_rope_norm_store"]


@triton.jit
def _norm_rope_row(
    row_ptr,
    w_ptr,
    cos,
    sin,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Load one head row, RMS-normalize it (if HAS_NORM), rotate; fp32 (x1', x2', whole row)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    mask_d = offs_d < D
    mask_h = offs_h < HALF
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(row_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    x1 = tl.load(row_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + HALF + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = tl.math.div_rn(tl.sum(x * x, axis=0), D * 1.0)
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        x = x * inv_rms * tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        x1 = x1 * inv_rms * tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        x2 = x2 * inv_rms * tl.load(w_ptr + HALF + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, x


@triton.jit
def _store_row(
    row_ptr,
    o1,
    o2,
    rest,
    WRITE_REST: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Store rotated halves at [0, r) and, if WRITE_REST, the pass-through dims [r, D)."""
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HALF
    dtype = row_ptr.dtype.element_ty
    tl.store(row_ptr + offs_h, cast_for_store(o1, dtype), mask=mask_h)
    tl.store(row_ptr + HALF + offs_h, cast_for_store(o2, dtype), mask=mask_h)
    if WRITE_REST:
        offs_d = tl.arange(0, BLOCK_D)
        mask_rest = (offs_d >= 2 * HALF) & (offs_d < D)
        tl.store(row_ptr + offs_d, cast_for_store(rest, dtype), mask=mask_rest)


@triton.jit
def _rope_norm_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, qw_ptr, kw_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, cs_stride, eps,
    NUM_Q_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HALF
    cs_row = cos_sin_ptr + tl.load(pos_ptr + tok).to(tl.int64) * cs_stride
    cos = tl.load(cs_row + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        q_row = q_ptr + tok * q_stride_t + head * q_stride_h
        o1, o2, rest = _norm_rope_row(
            q_row, qw_ptr, cos, sin, eps, D, HALF, HAS_Q_NORM, BLOCK_D, BLOCK_H
        )
        _store_row(q_row, o1, o2, rest, HAS_Q_NORM, D, HALF, BLOCK_D, BLOCK_H)
    else:
        kv_head = head - NUM_Q_HEADS
        k_row = k_ptr + tok * k_stride_t + kv_head * k_stride_h
        o1, o2, rest = _norm_rope_row(
            k_row, kw_ptr, cos, sin, eps, D, HALF, HAS_K_NORM, BLOCK_D, BLOCK_H
        )
        _store_row(k_row, o1, o2, rest, HAS_K_NORM, D, HALF, BLOCK_D, BLOCK_H)
        # The cache gets k exactly as stored in place (rounded to k's dtype), then cast.
        k_dtype = k_ptr.dtype.element_ty
        o1 = cast_for_store(o1, k_dtype).to(tl.float32)
        o2 = cast_for_store(o2, k_dtype).to(tl.float32)
        rest = cast_for_store(rest, k_dtype).to(tl.float32)
        slot = tl.load(loc_ptr + tok).to(tl.int64)
        kc_row = k_cache_ptr + slot * kc_stride_s + kv_head * kc_stride_h
        _store_row(kc_row, o1, o2, rest, True, D, HALF, BLOCK_D, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        v_row = v_ptr + tok * v_stride_t + kv_head * v_stride_h
        v = tl.load(v_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        vc_row = v_cache_ptr + slot * vc_stride_s + kv_head * vc_stride_h
        tl.store(vc_row + offs_d, cast_for_store(v, v_cache_ptr.dtype.element_ty), mask=mask_d)


def launch_rope_norm_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    norm_weights: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    rotary_dim: int,
) -> None:
    """Launch the (T, Hq + Hkv) grid; arguments are validated by the public wrapper."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    q_w, k_w = norm_weights
    grid = (num_tokens, num_q_heads + k.shape[1])
    _rope_norm_store_kernel[grid](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc,
        q if q_w is None else q_w, k if k_w is None else k_w,  # never read when the norm is off
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, D=head_dim, HALF=rotary_dim // 2,
        HAS_Q_NORM=q_w is not None, HAS_K_NORM=k_w is not None,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=triton.next_power_of_2(rotary_dim // 2),
        num_warps=1 if head_dim <= 128 else 2,
    )  # fmt: skip
