"""Triton kernel of `beam_cascade_attention`: one program per (request, kv head, query tile).

The GQA group is packed into the M dimension: packed row m of a tile is beam row m // GROUP, q
head kv_head * GROUP + m % GROUP, so every K/V tile gathered from the request's prompt feeds all
q heads that share it, through one tl.dot. The program runs an online softmax (fp32 running max,
sum and accumulator; exp2 with log2(e) folded into the scale) over the prompt slots in BLOCK_N
chunks, then over each row's S own slots (per-row K/V vectors: elementwise products and row
sums), then normalizes and stores bf16.

Under the interpreter, bf16 tl.dot and bf16 arithmetic are broken (triton-lang/triton#11584), so
the dot operands are fp32 holding bf16-rounded values there: the same operand values as the bf16
dot on a GPU (K/V from FP8 convert exactly; P is rounded to bf16 by `round_to_bf16`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import triton_interpreting
from .triton_fp8 import cast_for_store, round_to_bf16

__all__ = ["BLOCK_M", "BLOCK_N", "NUM_STAGES", "NUM_WARPS", "launch_beam_cascade_attention"]

# Tuning knobs, chosen from common flash-attention configs for H100/H200 (not yet measured here):
# BLOCK_M packed (row, q head) pairs per program: 128 for head_dim <= 128 (a [128, D] fp32
# accumulator fits 8 warps' registers), 64 above. A 50-beam request with GQA group 2 (100
# packed rows) fills one tile. BLOCK_N prompt slots per K/V chunk.
BLOCK_M = {64: 128, 128: 128, 256: 64}
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
_LOG2E = math.log2(math.e)


@triton.jit
def _dot_operand(x, INTERPRET: tl.constexpr):
    """bf16 for a GPU tl.dot; under the interpreter fp32 holding the same bf16-rounded values."""
    if INTERPRET:
        return round_to_bf16(x.to(tl.float32))
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _scores(qk, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Scores in log2 units. With SOFTCAP, qk_scale is sm_scale / cap and the score is
    cap * tanh(sm_scale * qk / cap) (times log2 e), tanh written as 1 - 2 / (1 + exp(2x)): the
    interpreter has no tanh, and this form saturates to +-1 instead of overflowing to NaN."""
    if SOFTCAP:
        x = qk * qk_scale
        return (1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))) * cap_log2
    else:
        return qk * qk_scale


@triton.jit
def _prefix_chunk(
    q, k_cache_ptr, v_cache_ptr, idx_ptr, n0, num_prefix, kc_head, vc_head, kc_stride_s,
    vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2,
    D: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Fold prompt slots [n0, n0 + BLOCK_N) into the running (max, sum, accumulator)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_prefix
    offs_d = tl.arange(0, D)
    slots = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    k_ptrs = k_cache_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :]
    k = _dot_operand(tl.load(k_ptrs, mask=mask_n[:, None], other=0.0), INTERPRET)  # [BLOCK_N, D]
    s = _scores(tl.dot(q, tl.trans(k)), qk_scale, cap_log2, SOFTCAP)  # [BLOCK_M, BLOCK_N]
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v_ptrs = v_cache_ptr + vc_head + slots[:, None] * vc_stride_s + offs_d[None, :]
    v = _dot_operand(tl.load(v_ptrs, mask=mask_n[:, None], other=0.0), INTERPRET)
    acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, INTERPRET), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _suffix_slot(
    q, k_cache_ptr, v_cache_ptr, slot_ptrs, mask_m, kc_head, vc_head, kc_stride_s, vc_stride_s,
    m_i, l_i, acc, qk_scale, cap_log2, D: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Fold one own slot per packed row (each row its own K/V vector) into the running state."""
    offs_d = tl.arange(0, D)
    slots = tl.load(slot_ptrs, mask=mask_m, other=0).to(tl.int64)  # [BLOCK_M]
    k = tl.load(k_cache_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :])
    s = _scores(tl.sum(q * k.to(tl.float32), axis=1), qk_scale, cap_log2, SOFTCAP)  # [BLOCK_M]
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    v = tl.load(v_cache_ptr + vc_head + slots[:, None] * vc_stride_s + offs_d[None, :])
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
    return m_new, l_i * alpha + p, acc


@triton.jit
def _beam_cascade_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, prefix_indptr_ptr, prefix_idx_ptr, row_indptr_ptr,
    suffix_ptr, o_ptr,
    q_stride_r, q_stride_h, kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h,
    sfx_stride_r, sfx_stride_s, o_stride_r, o_stride_h, qk_scale, cap_log2,
    GROUP: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    row_start = tl.load(row_indptr_ptr + req)
    num_packed = (tl.load(row_indptr_ptr + req + 1) - row_start) * GROUP
    if tile * BLOCK_M >= num_packed:
        return  # the static grid covers max_rows_per_request; this request has fewer rows
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_packed
    rows = (row_start + offs_m // GROUP).to(tl.int64)  # [BLOCK_M] beam rows
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] q heads
    offs_d = tl.arange(0, D)
    q_ptrs = q_ptr + rows[:, None] * q_stride_r + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D] bf16
    q_dot = _dot_operand(q, INTERPRET)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: exp2(m_i - m_new) never sees inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    prefix_start = tl.load(prefix_indptr_ptr + req)
    num_prefix = tl.load(prefix_indptr_ptr + req + 1) - prefix_start
    idx_ptr = prefix_idx_ptr + prefix_start
    kc_head, vc_head = kv_head.to(tl.int64) * kc_stride_h, kv_head.to(tl.int64) * vc_stride_h
    if INTERPRET:
        # The interpreter cannot take a loaded scalar as a range() bound (int() of a 1-element
        # array fails under numpy >= 2.4); a while loop only needs its truth value.
        n0 = 0
        while n0 < num_prefix:
            m_i, l_i, acc = _prefix_chunk(
                q_dot, k_cache_ptr, v_cache_ptr, idx_ptr, n0, num_prefix, kc_head, vc_head,
                kc_stride_s, vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, D, BLOCK_N, INTERPRET,
                SOFTCAP,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, num_prefix, BLOCK_N):  # a for loop, so the compiler pipelines loads
            m_i, l_i, acc = _prefix_chunk(
                q_dot, k_cache_ptr, v_cache_ptr, idx_ptr, n0, num_prefix, kc_head, vc_head,
                kc_stride_s, vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, D, BLOCK_N, INTERPRET,
                SOFTCAP,
            )  # fmt: skip

    q_f32 = q.to(tl.float32)
    for j in tl.static_range(S):
        slot_ptrs = suffix_ptr + rows * sfx_stride_r + j * sfx_stride_s
        m_i, l_i, acc = _suffix_slot(
            q_f32, k_cache_ptr, v_cache_ptr, slot_ptrs, mask_m, kc_head, vc_head,
            kc_stride_s, vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, D, SOFTCAP,
        )  # fmt: skip

    o = acc / l_i[:, None]
    o_ptrs = o_ptr + rows[:, None] * o_stride_r + heads[:, None] * o_stride_h + offs_d[None, :]
    tl.store(o_ptrs, cast_for_store(o, o_ptr.dtype.element_ty), mask=mask_m[:, None])


def launch_beam_cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_indptr: torch.Tensor,
    prefix_indices: torch.Tensor,
    row_indptr: torch.Tensor,
    suffix: torch.Tensor,
    sm_scale: float,
    max_rows_per_request: int,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    logit_softcap: float | None = None,
) -> None:
    """Launch the (B, Hkv, tiles) grid; arguments are validated by the public wrapper.

    block_m / block_n override the tile shape (tests use small tiles to cover several tiles and
    chunks at interpreter-friendly sizes).
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_m = BLOCK_M[min(max(head_dim, 64), 256)] if block_m is None else block_m
    num_tiles = triton.cdiv(max_rows_per_request * group, block_m)
    if num_rows == 0:
        return
    grid = (row_indptr.numel() - 1, num_kv_heads, num_tiles)
    if logit_softcap is None:
        qk_scale, cap_log2 = sm_scale * _LOG2E, 0.0
    else:
        qk_scale, cap_log2 = sm_scale / logit_softcap, logit_softcap * _LOG2E
    _beam_cascade_attention_kernel[grid](
        q, k_cache, v_cache, prefix_indptr, prefix_indices, row_indptr, suffix, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), suffix.stride(0), suffix.stride(1),
        out.stride(0), out.stride(1), qk_scale, cap_log2,
        GROUP=group, S=suffix.shape[1], D=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=triton_interpreting(),
        SOFTCAP=logit_softcap is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
