"""Triton kernel of `prefill_attention`: one program per (tile, kv head).

A tile is BLOCK_M packed rows of one sequence (row m: token m // GROUP, q head
kv_head * GROUP + m % GROUP), so each K/V chunk gathered from the pool feeds every q head that
shares it through one tl.dot. The program folds the sequence's keys into an online softmax in
BLOCK_N chunks (fp32 running max, sum and accumulator; exp2 with log2(e) folded into the scale):
first the chunks every row of the tile sees whole (no mask), then the chunks along the causal
diagonal (masked); keys after the tile's last token are never read. With a sliding window every
chunk is masked and the loop starts at the window of the tile's first token.

Split-KV. A prefill's tiles number (tokens x GROUP / BLOCK_M) x Hkv programs, 120 for one
960-token prompt of the bench preset's shape: enough to fill the GPU. A few new tokens over a long
cached prompt are a few programs, each walking the whole prompt alone; then (`auto_num_splits`,
the beam kernel's rule: only while the grid leaves at least half the SMs idle) each tile's keys
are cut into 2-16 ranges of whole chunks, one program each, writing fp32 partials (accumulator,
running max and sum) that the beam kernel's `_merge_splits_kernel` combines, each sequence's
tokens taken as one request's rows. The split count follows from the launch shape alone, so a
CUDA graph replays the count it captured.

Interpreter: the dot operands are fp32 holding bf16-rounded values, as in the beam kernel
(triton-lang/triton#11584), and loops over loaded bounds are while loops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import triton_interpreting
from .triton_beam_attention import (
    _fp8_query_rows,
    _operand,
    _query_operand,
    _softmax_step,
    auto_num_splits,
    check_fp8_scores,
    merge_splits,
    score_scales,
    split_partials,
    use_f16_dots,
)
from .triton_fp8 import cast_for_store

__all__ = ["NUM_STAGES", "NUM_WARPS", "default_block_n", "launch_prefill_attention"]

NUM_WARPS = 8
NUM_STAGES = 2
# Launch chosen on an H200 (scripts/bench_prefill_attention.py, docs/benchmarks.md, session 20):
# at head_dim 128, 128-row tiles over 128-key chunks at 8 warps and 2 stages were the fastest
# of 8 configurations for prompts of 960-4,096 new tokens (47 us for one 960-token prompt
# against 60 us with 64-key chunks) and within 6% of the best elsewhere; the measured time is
# what decided. For sm_90 (ptxas, arguments specialized as on the device) it spills nothing;
# 4-warp launches with 128-row tiles spill 0.5-4 KB. head_dim 256 (unmeasured) takes 64-key
# chunks at 8 warps.
_M_INIT = tl.constexpr(-1.0e30)  # finite: exp2(m - m_new) never sees inf - inf


@triton.jit
def _chunk(
    q, k_ptr, v_ptr, idx_ptr, n0, hi, pos, kc_head, vc_head, kc_stride_s, vc_stride_s,
    m_i, l_i, acc, qk_scale, cap_log2, window,
    D: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr, WINDOW: tl.constexpr, F16: tl.constexpr, FP8_QK: tl.constexpr,
):  # fmt: skip
    """Fold keys [n0, n0 + BLOCK_N) into the running (max, sum, accumulator). MASKED: the chunk
    crosses the causal diagonal, the sliding window or `hi` (the keys' end). FP8_QK: q holds
    e4m3 codes and the keys enter the score dot as loaded (qk_scale carries each row's scale)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if MASKED:
        mask_n = offs_n < hi
        slots = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :],
            mask=mask_n[:, None], other=0.0,
        )  # fmt: skip
    else:
        slots = tl.load(idx_ptr + offs_n).to(tl.int64)
        k = tl.load(k_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :])
    if FP8_QK:
        qk = tl.dot(q, tl.trans(k))
    else:
        qk = tl.dot(q, tl.trans(_operand(k, F16, INTERPRET)))
    if MASKED:
        seen = (offs_n[None, :] <= pos[:, None]) & mask_n[None, :]
        if WINDOW:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
    else:
        seen = None
    m_new, alpha, p = _softmax_step(qk, seen, m_i, qk_scale, cap_log2, SOFTCAP, MASKED, FP8_QK)
    v_ptrs = v_ptr + vc_head + slots[:, None] * vc_stride_s + offs_d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(_operand(p, F16, INTERPRET), _operand(v, F16, INTERPRET))
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_idx_ptr, tiles_ptr, o_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    q_stride_t, q_stride_h, kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h,
    o_stride_t, o_stride_h, part_stride_split, qk_scale, cap_log2, window,
    GROUP: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INTERPRET: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, F16: tl.constexpr, FP8_QK: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + 2 * tile)
    if seq < 0:
        return  # a spare program of a fixed (graph) grid
    first = tl.load(tiles_ptr + 2 * tile + 1)  # the tile's first packed row
    q_start = tl.load(qo_indptr_ptr + seq)
    qo_len = tl.load(qo_indptr_ptr + seq + 1) - q_start
    kv_start = tl.load(kv_indptr_ptr + seq)
    kv_len = tl.load(kv_indptr_ptr + seq + 1) - kv_start
    past = kv_len - qo_len  # keys before the sequence's first new token
    offs_m = first + tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    mask_m = tok < qo_len
    heads = kv_head * GROUP + offs_m % GROUP
    pos = past + tok  # [BLOCK_M] each row's position: it sees keys <= pos
    offs_d = tl.arange(0, D)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=mask_m[:, None], other=0.0,
    )  # fmt: skip
    if FP8_QK:  # each packed row's e4m3 codes, its scale folded into the score scale
        q, q_scale = _fp8_query_rows(q)
        qk_scale = qk_scale * q_scale[:, None]
    else:
        q = _query_operand(q, F16, INTERPRET)

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    first_pos = past + first // GROUP
    hi = past + tl.minimum(qo_len, (first + BLOCK_M - 1) // GROUP + 1)  # keys [0, hi) are read
    idx_ptr = kv_idx_ptr + kv_start
    kc_head, vc_head = kv_head.to(tl.int64) * kc_stride_h, kv_head.to(tl.int64) * vc_stride_h
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full = lo  # every chunk masked
    else:
        lo = 0
        full = (first_pos + 1) // BLOCK_N * BLOCK_N  # chunks below it: every row sees them whole
    if SPLITS > 1:  # this program's share of [lo, hi): whole chunks, the last split the rest
        per_split = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(lo + per_split, hi)
        full = tl.maximum(tl.minimum(full, hi), lo)
    if INTERPRET:
        # The interpreter cannot take a loaded scalar as a range() bound (int() of a 1-element
        # array fails under numpy >= 2.4); a while loop only needs its truth value.
        n0 = lo
        while n0 < full:
            m_i, l_i, acc = _chunk(
                q, k_ptr, v_ptr, idx_ptr, n0, hi, pos, kc_head, vc_head, kc_stride_s,
                vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, window,
                D, BLOCK_N, INTERPRET, SOFTCAP, False, WINDOW, F16, FP8_QK,
            )  # fmt: skip
            n0 += BLOCK_N
        while n0 < hi:
            m_i, l_i, acc = _chunk(
                q, k_ptr, v_ptr, idx_ptr, n0, hi, pos, kc_head, vc_head, kc_stride_s,
                vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, window,
                D, BLOCK_N, INTERPRET, SOFTCAP, True, WINDOW, F16, FP8_QK,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(lo, full, BLOCK_N):  # for loops, so the compiler pipelines the loads
            m_i, l_i, acc = _chunk(
                q, k_ptr, v_ptr, idx_ptr, n0, hi, pos, kc_head, vc_head, kc_stride_s,
                vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, window,
                D, BLOCK_N, INTERPRET, SOFTCAP, False, WINDOW, F16, FP8_QK,
            )  # fmt: skip
        for n0 in range(full, hi, BLOCK_N):
            m_i, l_i, acc = _chunk(
                q, k_ptr, v_ptr, idx_ptr, n0, hi, pos, kc_head, vc_head, kc_stride_s,
                vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2, window,
                D, BLOCK_N, INTERPRET, SOFTCAP, True, WINDOW, F16, FP8_QK,
            )  # fmt: skip

    if SPLITS == 1:
        o = acc / tl.where(mask_m, l_i, 1.0)[:, None]  # rows past the sequence: not stored
        o_ptrs = o_ptr + rows[:, None] * o_stride_t + heads[:, None] * o_stride_h + offs_d[None, :]
        tl.store(o_ptrs, cast_for_store(o, o_ptr.dtype.element_ty), mask=mask_m[:, None])
    else:  # partials [SPLITS, T, HQ(, D)], merged by the beam kernel's merge
        packed = split * part_stride_split + rows * HQ + heads
        tl.store(part_m_ptr + packed, m_i, mask=mask_m)
        tl.store(part_l_ptr + packed, l_i, mask=mask_m)
        tl.store(part_acc_ptr + packed[:, None] * D + offs_d[None, :], acc, mask=mask_m[:, None])


def default_block_n(head_dim: int) -> int:
    """Keys per chunk: 128 up to head_dim 128, 64 above (see the launch note above)."""
    return 128 if head_dim <= 128 else 64


def launch_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    logit_softcap: float | None,
    window: int | None,
    block_m: int,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    num_splits: int | None = None,
    f16_dots: bool | None = None,
    fp8_scores: bool = False,
) -> None:
    """Launch the (tiles, Hkv, splits) grid, and the merge when splits > 1; arguments are
    validated by the public wrapper. block_n defaults to `default_block_n(head_dim)`,
    num_splits to `auto_num_splits` of the grid (the beam kernel's rule), f16_dots as
    `use_f16_dots` decides.

    fp8_scores (an experiment, off by default; `EngineConfig.fp8_attention_scores` and
    scripts/bench_prefill_attention.py turn it on): the score dot on FP8 tensor cores, each
    packed query row quantized in the kernel to e4m3 with its own scale (amax / 448) and the
    FP8 keys taken as loaded, with no conversion; values and P stay as `f16_dots` has them.
    Twice the dot rate and half the conversions, for queries rounded to 4 significant bits
    instead of 8. Needs an FP8 cache."""
    check_fp8_scores(k_cache, fp8_scores)
    num_tiles, num_tokens = tiles.shape[0], q.shape[0]
    if num_tiles == 0 or num_tokens == 0:
        return
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = auto_num_splits(num_tiles * num_kv_heads, q.device)
    part_acc, part_m, part_l = split_partials(num_splits, q, out)
    qk_scale, cap_log2 = score_scales(sm_scale, logit_softcap)
    _prefill_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, tiles, out,
        part_acc, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        num_tokens * num_q_heads, qk_scale, cap_log2, 0 if window is None else window,
        GROUP=group, D=head_dim, HQ=num_q_heads, BLOCK_M=block_m,
        BLOCK_N=default_block_n(head_dim) if block_n is None else block_n, SPLITS=num_splits,
        INTERPRET=triton_interpreting(), SOFTCAP=logit_softcap is not None,
        WINDOW=window is not None,
        F16=use_f16_dots(k_cache, f16_dots), FP8_QK=fp8_scores,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:  # one "request" per sequence, its tokens as rows (static bound: T)
        merge_splits(qo_indptr, out, (part_acc, part_m, part_l), num_kv_heads, num_tokens,
                     num_splits)  # fmt: skip
