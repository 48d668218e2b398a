"""Triton kernel of `rope_norm_store`: one program per (block of tokens, block of up to 16
heads); one token per program by default (`tokens_per_program`).

q blocks rotate q heads in place; kv blocks rotate k heads in place and store them and the
matching v heads into the caches at out_loc, and with a mirror also into rows of two more
buffers in k's dtype (a fresh prefill's keys). All offsets are explicit strides, so q/k/v can
be zero-copy views of the fused qkv buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import cast_for_store

__all__ = ["launch_rope_norm_store"]


HEADS_PER_PROGRAM = 16
"""Heads one program rotates (a [16, D] tile): one program per head launched ~4M tiny programs
per prefill wave and ran at ~4x the kernel's bandwidth floor on an H200."""


@triton.jit
def _norm_rope_rows(
    rows_ptr,
    mask_rows,
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
    """Load a block of head rows ([R] pointers), RMS-normalize each (if HAS_NORM), rotate by
    each row's cos / sin ([R, BLOCK_H]); fp32 (x1', x2', whole rows), each [R, BLOCK_H or
    BLOCK_D]."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    mask_x = mask_rows[:, None] & (offs_d < D)[None, :]
    mask_half = mask_rows[:, None] & (offs_h < HALF)[None, :]
    # fp32 right after every load: the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(rows_ptr[:, None] + offs_d[None, :], mask=mask_x, other=0.0).to(tl.float32)
    x1 = tl.load(rows_ptr[:, None] + offs_h[None, :], mask=mask_half, other=0.0).to(tl.float32)
    x2_ptrs = rows_ptr[:, None] + HALF + offs_h[None, :]
    x2 = tl.load(x2_ptrs, mask=mask_half, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = tl.math.div_rn(tl.sum(x * x, axis=1), D * 1.0)
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))[:, None]
        w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)[None, :]
        w1 = tl.load(w_ptr + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)[None, :]
        x = x * inv_rms * w
        x1 = x1 * inv_rms * w1
        x2 = x2 * inv_rms * w2
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, x


@triton.jit
def _store_rows(
    rows_ptr,
    mask_rows,
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
    mask_half = mask_rows[:, None] & (offs_h < HALF)[None, :]
    dtype = rows_ptr.dtype.element_ty
    tl.store(rows_ptr[:, None] + offs_h[None, :], cast_for_store(o1, dtype), mask=mask_half)
    tl.store(rows_ptr[:, None] + HALF + offs_h[None, :], cast_for_store(o2, dtype), mask=mask_half)
    if WRITE_REST:
        offs_d = tl.arange(0, BLOCK_D)
        mask_rest = mask_rows[:, None] & ((offs_d >= 2 * HALF) & (offs_d < D))[None, :]
        tl.store(rows_ptr[:, None] + offs_d[None, :], cast_for_store(rest, dtype), mask=mask_rest)


@triton.jit
def _store_kv(
    k_dst, v_dst, idx_ptr, idx_stride, k_stride_s, k_stride_h, v_stride_s, v_stride_h, tok,
    heads, mask_r, o1, o2, rest, v_rows, BLOCK_T: tl.constexpr, D: tl.constexpr,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Rotated k (o1, o2, rest, fp32) and the v rows at `v_rows` of each token into row
    idx_ptr[tok] of k_dst / v_dst, cast to their dtype: the pool's slots, or the mirror's rows.
    k is stored before v is loaded, which keeps fewer registers live."""
    if BLOCK_T == 1:
        idx = tl.load(idx_ptr + tok * idx_stride).to(tl.int64)
    else:  # masked-out rows (past the last token) read index 0 and store nothing
        idx = tl.load(idx_ptr + tok * idx_stride, mask=mask_r, other=0).to(tl.int64)
    k_rows = k_dst + idx * k_stride_s + heads * k_stride_h
    _store_rows(k_rows, mask_r, o1, o2, rest, True, D, HALF, BLOCK_D, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_v = mask_r[:, None] & (offs_d < D)[None, :]
    v = tl.load(v_rows[:, None] + offs_d[None, :], mask=mask_v, other=0.0).to(tl.float32)
    out_rows = v_dst + idx * v_stride_s + heads * v_stride_h
    tl.store(
        out_rows[:, None] + offs_d[None, :], cast_for_store(v, v_dst.dtype.element_ty), mask=mask_v
    )


@triton.jit
def _rope_norm_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, qw_ptr, kw_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, cs_stride, pos_stride, loc_stride, eps,
    mk_ptr, mv_ptr, mrow_ptr, mk_stride_s, mk_stride_h, mv_stride_s, mv_stride_h, mrow_stride,
    num_tokens, HAS_MIRROR: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_BLOCKS: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_T tokens, head block): head blocks < Q_BLOCKS rotate BLOCK_R q
    heads of each token in place; the others rotate BLOCK_R k heads in place and store them and
    the matching v heads into the caches (and, if HAS_MIRROR, both into the mirror's rows).
    Its BLOCK_T x BLOCK_R head rows are one flat block."""
    block = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_T * BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    if BLOCK_T == 1:
        # One token: its index, slot and cos / sin row are scalars ([1, BLOCK_H]) and no row is
        # masked by token, as before BLOCK_T existed (64 registers at 4 warps for sm_90, by
        # ptxas -v; per-row values took 80).
        tok = tl.program_id(0).to(tl.int64)
        head = offs_r
        cs_row = cos_sin_ptr + tl.load(pos_ptr + tok * pos_stride).to(tl.int64) * cs_stride
        cos = tl.load(cs_row + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(cs_row + HALF + offs_h, mask=offs_h < HALF, other=0.0)
        sin = sin.to(tl.float32)[None, :]
    else:  # each row's own token, and its cos / sin ([R, BLOCK_H])
        tok = tl.program_id(0).to(tl.int64) * BLOCK_T + offs_r // BLOCK_R
        head = offs_r % BLOCK_R
        mask_t = tok < num_tokens
        mask_cs = mask_t[:, None] & (offs_h < HALF)[None, :]
        pos = tl.load(pos_ptr + tok * pos_stride, mask=mask_t, other=0).to(tl.int64)
        cs_rows = cos_sin_ptr + pos * cs_stride
        cos = tl.load(cs_rows[:, None] + offs_h[None, :], mask=mask_cs, other=0.0)
        cos = cos.to(tl.float32)
        sin = tl.load(cs_rows[:, None] + HALF + offs_h[None, :], mask=mask_cs, other=0.0)
        sin = sin.to(tl.float32)
    if block < Q_BLOCKS:
        q_heads = block * BLOCK_R + head
        mask_r = q_heads < NUM_Q_HEADS
        if BLOCK_T > 1:
            mask_r = mask_r & mask_t
        q_rows = q_ptr + tok * q_stride_t + q_heads.to(tl.int64) * q_stride_h
        o1, o2, rest = _norm_rope_rows(
            q_rows, mask_r, qw_ptr, cos, sin, eps, D, HALF, HAS_Q_NORM, BLOCK_D, BLOCK_H
        )
        _store_rows(q_rows, mask_r, o1, o2, rest, HAS_Q_NORM, D, HALF, BLOCK_D, BLOCK_H)
    else:
        kv_heads = (block - Q_BLOCKS) * BLOCK_R + head
        mask_r = kv_heads < NUM_KV_HEADS
        if BLOCK_T > 1:
            mask_r = mask_r & mask_t
        kv_heads = kv_heads.to(tl.int64)
        k_rows = k_ptr + tok * k_stride_t + kv_heads * k_stride_h
        o1, o2, rest = _norm_rope_rows(
            k_rows, mask_r, kw_ptr, cos, sin, eps, D, HALF, HAS_K_NORM, BLOCK_D, BLOCK_H
        )
        _store_rows(k_rows, mask_r, o1, o2, rest, HAS_K_NORM, D, HALF, BLOCK_D, BLOCK_H)
        # The cache gets k exactly as stored in place (rounded to k's dtype), then cast.
        k_dtype = k_ptr.dtype.element_ty
        o1 = cast_for_store(o1, k_dtype).to(tl.float32)
        o2 = cast_for_store(o2, k_dtype).to(tl.float32)
        rest = cast_for_store(rest, k_dtype).to(tl.float32)
        v_rows = v_ptr + tok * v_stride_t + kv_heads * v_stride_h
        _store_kv(
            k_cache_ptr, v_cache_ptr, loc_ptr, loc_stride, kc_stride_s, kc_stride_h, vc_stride_s,
            vc_stride_h, tok, kv_heads, mask_r, o1, o2, rest, v_rows, BLOCK_T, D, HALF, BLOCK_D,
            BLOCK_H,
        )  # fmt: skip
        if HAS_MIRROR:  # k as stored in place and v, in their own dtype: exact copies
            _store_kv(
                mk_ptr, mv_ptr, mrow_ptr, mrow_stride, mk_stride_s, mk_stride_h, mv_stride_s,
                mv_stride_h, tok, kv_heads, mask_r, o1, o2, rest, v_rows, BLOCK_T, D, HALF,
                BLOCK_D, BLOCK_H,
            )  # fmt: skip


SMALL_LAUNCH_TOKENS = 4096
"""Below this many tokens a program takes two tokens at 16 warps, from this many one token at
8 warps (for [16, 128] head blocks): the fastest configurations that
scripts/bench_elementwise.py found on an H100 at the bench preset's shape (16 q / 8 KV heads of
128), 18.4 us for 1,024 tokens (34.1 us at one token and 4 warps, the old default) and 70.5 us
for 8,184 (79.1 us). Two tokens at 16 warps is within 7% of the best even at 8,184 tokens, so
where between the two the threshold falls matters little (docs/benchmarks.md, session 19)."""


def default_launch(num_tokens: int, block_elems: int) -> tuple[int, int]:
    """(tokens per program, warps) for `num_tokens` tokens and head blocks of `block_elems`
    elements. Blocks of fewer than 2048 elements (few or small heads) keep the old one token at
    2 warps, which no device run has timed against others."""
    if block_elems < 2048:
        return 1, 2
    return (2, 16) if num_tokens < SMALL_LAUNCH_TOKENS else (1, 8)


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
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
    mirror: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Launch the (token blocks, q blocks + kv blocks) grid; arguments are validated by the
    public wrapper. `tokens_per_program` (a power of two) and `num_warps` are the launch
    configuration: by default `default_launch` (scripts/bench_elementwise.py tries others).
    `mirror`: (k_out, v_out, rows), token i's k and v also go to row rows[i] of each."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    q_w, k_w = norm_weights
    num_kv_heads = k.shape[1]
    block_r = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(num_q_heads, num_kv_heads)))
    q_blocks = triton.cdiv(num_q_heads, block_r)
    block_d = triton.next_power_of_2(head_dim)
    default_tokens, default_warps = default_launch(num_tokens, block_r * block_d)
    tokens_per_program = tokens_per_program or default_tokens
    num_warps = num_warps or default_warps
    grid = (
        triton.cdiv(num_tokens, tokens_per_program),
        q_blocks + triton.cdiv(num_kv_heads, block_r),
    )
    mk, mv, mrow = mirror if mirror is not None else (k, v, out_loc)  # never read without one
    _rope_norm_store_kernel[grid](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc,
        q if q_w is None else q_w, k if k_w is None else k_w,  # never read when the norm is off
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin_cache.stride(0), positions.stride(0), out_loc.stride(0), eps,
        mk, mv, mrow, mk.stride(0), mk.stride(1), mv.stride(0), mv.stride(1), mrow.stride(0),
        num_tokens, HAS_MIRROR=mirror is not None, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_BLOCKS=q_blocks,
        D=head_dim, HALF=rotary_dim // 2, HAS_Q_NORM=q_w is not None, HAS_K_NORM=k_w is not None,
        BLOCK_T=tokens_per_program, BLOCK_R=block_r, BLOCK_D=block_d,
        BLOCK_H=triton.next_power_of_2(rotary_dim // 2), num_warps=num_warps,
    )  # fmt: skip
