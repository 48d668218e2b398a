"""Triton kernel of `rope_norm_store`: one program per (token, group of q heads or of kv heads).

q-group programs rotate their q heads in place; kv-group programs rotate their k heads in place and
store them and the matching v heads into the caches at out_loc. A group is a [heads, D] tile, so
each program moves a few KB rather than one 256-byte head (3-4x faster at 4k tokens than one
program per head). All offsets are explicit strides: q/k/v can be views of the fused qkv buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import cast_for_store

__all__ = ["launch_rope_norm_store"]

_TILE_ELEMS = 2048  # heads per program = this / next_pow2(D), capped by the head count


@triton.jit
def _head_tile(base_ptr, head_stride, group, NUM_HEADS: tl.constexpr, HEADS: tl.constexpr):
    """Row pointers [HEADS, 1] and validity mask [HEADS, 1] of one group of heads."""
    heads = group * HEADS + tl.arange(0, HEADS)
    return base_ptr + heads[:, None] * head_stride, (heads < NUM_HEADS)[:, None]


@triton.jit
def _norm_rope(
    rows, valid, w_ptr, cos, sin, eps,
    D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """RMS-normalize each head (if HAS_NORM) and rotate: fp32 (x1', x2', whole rows)."""
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    mask_d = valid & (offs_d < D)
    mask_h = valid & (offs_h < HALF)
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(rows + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    x1 = tl.load(rows + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if HAS_NORM:
        # IEEE sqrt/div like torch: the approximate GPU ones drift from the reference by ulps.
        sum_sq = tl.sum(x * x, axis=1)
        mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, D * 1.0, tl.float32))
        root = tl.math.sqrt_rn(mean_sq + eps)
        inv_rms = tl.math.div_rn(tl.full(root.shape, 1.0, tl.float32), root)[:, None]
        x = x * inv_rms * tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        x1 = x1 * inv_rms * tl.load(w_ptr + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
        x2 = x2 * inv_rms * w2
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, x


@triton.jit
def _store(
    rows, valid, o1, o2, rest, WRITE_REST: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Store rotated halves at [0, r) and, if WRITE_REST, the pass-through dims [r, D)."""
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    mask_h = valid & (offs_h < HALF)
    dtype = rows.dtype.element_ty
    tl.store(rows + offs_h, cast_for_store(o1, dtype), mask=mask_h)
    tl.store(rows + HALF + offs_h, cast_for_store(o2, dtype), mask=mask_h)
    if WRITE_REST:
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        tl.store(
            rows + offs_d,
            cast_for_store(rest, dtype),
            mask=valid & (offs_d >= 2 * HALF) & (offs_d < D),
        )


@triton.jit
def _rope_norm_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, qw_ptr, kw_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, cs_stride, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    cs_row = cos_sin_ptr + tl.load(pos_ptr + tok).to(tl.int64) * cs_stride
    cos = tl.load(cs_row + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
    num_q_groups = tl.cdiv(NUM_Q_HEADS, Q_HEADS)
    if group < num_q_groups:
        rows, valid = _head_tile(q_ptr + tok * q_stride_t, q_stride_h, group, NUM_Q_HEADS, Q_HEADS)
        o1, o2, x = _norm_rope(
            rows, valid, qw_ptr, cos, sin, eps, D, HALF, HAS_Q_NORM, BLOCK_D, BLOCK_H
        )
        _store(rows, valid, o1, o2, x, HAS_Q_NORM, D, HALF, BLOCK_D, BLOCK_H)
    else:
        # NOTE: names differ from the q branch: Triton needs one type per name across branches,
        # and the q and kv head tiles have different shapes.
        kv_group = group - num_q_groups
        k_rows, k_valid = _head_tile(
            k_ptr + tok * k_stride_t, k_stride_h, kv_group, NUM_KV_HEADS, KV_HEADS
        )
        k1, k2, kx = _norm_rope(
            k_rows, k_valid, kw_ptr, cos, sin, eps, D, HALF, HAS_K_NORM, BLOCK_D, BLOCK_H
        )
        _store(k_rows, k_valid, k1, k2, kx, HAS_K_NORM, D, HALF, BLOCK_D, BLOCK_H)
        # The cache gets k exactly as stored in place (rounded to k's dtype), then cast.
        k_dtype = k_ptr.dtype.element_ty
        k1 = cast_for_store(k1, k_dtype).to(tl.float32)
        k2 = cast_for_store(k2, k_dtype).to(tl.float32)
        kx = cast_for_store(kx, k_dtype).to(tl.float32)
        slot = tl.load(loc_ptr + tok).to(tl.int64)
        kc_base = k_cache_ptr + slot * kc_stride_s
        kc_rows, _ = _head_tile(kc_base, kc_stride_h, kv_group, NUM_KV_HEADS, KV_HEADS)
        _store(kc_rows, k_valid, k1, k2, kx, True, D, HALF, BLOCK_D, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask_d = k_valid & (offs_d < D)
        v_rows, _ = _head_tile(
            v_ptr + tok * v_stride_t, v_stride_h, kv_group, NUM_KV_HEADS, KV_HEADS
        )
        v = tl.load(v_rows + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        vc_base = v_cache_ptr + slot * vc_stride_s
        vc_rows, _ = _head_tile(vc_base, vc_stride_h, kv_group, NUM_KV_HEADS, KV_HEADS)
        tl.store(vc_rows + offs_d, cast_for_store(v, v_cache_ptr.dtype.element_ty), mask=mask_d)


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
    """Launch a (T, q groups + kv groups) grid; arguments are validated by the public wrapper."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    per_prog = max(1, _TILE_ELEMS // block_d)
    q_heads = min(per_prog, triton.next_power_of_2(num_q_heads))
    kv_heads = min(per_prog, triton.next_power_of_2(num_kv_heads))
    grid = (num_tokens, triton.cdiv(num_q_heads, q_heads) + triton.cdiv(num_kv_heads, kv_heads))
    q_w, k_w = norm_weights
    _rope_norm_store_kernel[grid](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc,
        q if q_w is None else q_w, k if k_w is None else k_w,  # never read when the norm is off
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS=q_heads, KV_HEADS=kv_heads,
        D=head_dim, HALF=rotary_dim // 2,
        HAS_Q_NORM=q_w is not None, HAS_K_NORM=k_w is not None,
        BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(rotary_dim // 2),
        num_warps=4,
    )  # fmt: skip
