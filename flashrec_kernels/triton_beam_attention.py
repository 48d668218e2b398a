"""Triton kernel of `beam_cascade_attention`: one program per (request, kv head, query tile).

The GQA group is packed into the M dimension: packed row m of a tile is beam row m // GROUP, q
head kv_head * GROUP + m % GROUP, so every K/V tile gathered from the request's prompt feeds all
q heads that share it, through one tl.dot. The program runs an online softmax (fp32 running max,
sum and accumulator; exp2 with log2(e) folded into the scale) over each row's S own slots first
(per-row K/V vectors: elementwise products and row sums; a negative slot is skipped), then over
the prompt slots in BLOCK_N chunks (whole chunks without masks, then the part chunk that ends
the range), then normalizes and stores bf16.

Split-KV. A step of few requests launches few programs (one 50-beam request: 8, one per kv head,
on a 132-SM H200: 51 us a layer, each program walking the whole prompt). `num_splits` > 1 cuts
each request's prompt into that many contiguous ranges of whole BLOCK_N chunks, one program per
range; each writes its unnormalized fp32 accumulator with its running max and sum, split 0 also
folding in the rows' own slots, and `_merge_splits_kernel` combines them (the same rescaling as
the online softmax). The split count depends only on the launch shape (`auto_num_splits`), so a
CUDA graph captures and replays the same one whatever the prompt lengths.

Over an FP8 cache the prompt chunks' dots take fp16 operands, over a bf16 cache bf16 ones
(`_operand`: converting e4m3 to fp16 is a third of the instructions). Under the interpreter,
bf16 tl.dot and bf16 arithmetic are broken (triton-lang/triton#11584), so the dot operands are
fp32 holding the values rounded to the GPU's operand type there: the same operand values as the
GPU's dot (K/V from FP8 convert exactly; P is rounded to fp16, or to bf16 by `round_to_bf16`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .device import triton_interpreting
from .triton_fp8 import cast_for_store, fp8_scale, round_to_bf16, to_fp8

__all__ = [
    "BLOCK_M", "BLOCK_N", "FIVE_STAGE_SHARED_BYTES", "MAX_SPLITS", "MERGE_BLOCK_M", "NUM_STAGES",
    "NUM_WARPS", "UNSPLIT_LAUNCH", "auto_num_splits", "check_fp8_scores",
    "launch_beam_cascade_attention", "merge_splits", "score_scales", "split_partials",
    "unsplit_stages",
]  # fmt: skip

# Tuning knobs. BLOCK_M packed (row, q head) pairs per program: 128 for head_dim
# <= 128 (a [128, D] fp32 accumulator fits 8 warps' registers), 64 above. A 50-beam request with
# GQA group 2 (100 packed rows) fills one tile. BLOCK_N prompt slots per K/V chunk, NUM_STAGES
# software-pipeline depth: an unsplit launch at head_dim <= 128 takes the prefill kernel's
# 128-slot chunks (`UNSPLIT_LAUNCH`, 7-17% faster than 64-slot chunks at every shape of
# scripts/bench_attention.py, docs/benchmarks.md session 28) with `unsplit_stages`; a split
# launch keeps 64 slots and 2 stages: its programs walk a short range (a 1,024-token prompt in 16
# splits is one 64-slot chunk each), and head_dim 256 keeps them too (unmeasured).
BLOCK_M = {64: 128, 128: 128, 256: 64}
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
UNSPLIT_LAUNCH = {"block_n": 128, "num_stages": 3}
"""The unsplit launch where `unsplit_stages` finds no room for more stages."""
FIVE_STAGE_SHARED_BYTES = 132_096
"""Shared memory of the unsplit launch over an FP8 cache at 5 stages on sm_90 (Triton 3.6; 98,816
at 3), checked by tests/kernels/test_sm90_compile.py. Over a bf16 cache 5 stages take 230,400."""
_LOG2E = math.log2(math.e)
MAX_SPLITS = 16
"""Most prompt ranges per (request, kv head, tile): 16 x 64-slot chunks cover a 1,024-token
prompt with one chunk per program; more would only add partials to merge."""
MERGE_BLOCK_M = 8
"""Packed rows per merge program. The merge is a pure read of the partials, so it wants many
small programs: with the attention's 128-row tiles, one 50-beam request's merge ran 8
programs (25 us a layer on an H200, more than the split attention itself)."""
# finite: exp2(m - m_new) never sees inf - inf, and an empty split weighs 0
_M_INIT = tl.constexpr(-1.0e30)


_F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _operand(x, F16: tl.constexpr, INTERPRET: tl.constexpr):
    """A tl.dot operand: fp16 with F16 (an FP8 cache), else bf16. Under the interpreter, fp32
    holding the values on that grid (its dots are fp32, as the GPU's accumulation). sm_90
    converts e4m3 to fp16 in one instruction per pair and to bf16 in three (through fp16), for
    every key and value element of every chunk; fp16 holds every e4m3 value and every bf16
    query element in [2^-14, 65504] exactly, and rounds P to 11 significant bits instead of
    bf16's 8 (below 2^-14, where P barely counts, to a fixed 2^-24)."""
    if F16:
        if INTERPRET:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x.to(tl.float16)
    elif INTERPRET:
        return round_to_bf16(x.to(tl.float32))
    else:
        return x.to(tl.bfloat16)


def use_f16_dots(k_cache: torch.Tensor, requested: bool | None) -> bool:
    """Whether a launch's dots take fp16 operands (`_operand`): `requested`, or by default
    whether the cache is FP8 (a bf16 cache keeps bf16 dots, whose range it may need)."""
    return k_cache.dtype == torch.float8_e4m3fn if requested is None else requested


@triton.jit
def _query_operand(q, F16: tl.constexpr, INTERPRET: tl.constexpr):
    """A bf16 query tile as a dot operand; for fp16 clamped to its range first (an element past
    65504 would be infinite; no model's queries come near it)."""
    if F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -_F16_MAX), _F16_MAX)
    return _operand(q, F16, INTERPRET)


@triton.jit
def _fp8_query_rows(q):
    """(e4m3 codes, [BLOCK_M] scales) of a bf16 query tile, each row under its own scale
    (amax / 448): the FP8 score dot's operand (`fp8_scores`), the scale applied to the scores."""
    q = q.to(tl.float32)
    row_scale = fp8_scale(tl.max(tl.abs(q), axis=1))
    return to_fp8(q, row_scale[:, None]), row_scale


def check_fp8_scores(k_cache: torch.Tensor, fp8_scores: bool) -> None:
    """The FP8 score dot takes the keys as loaded: an FP8 cache only."""
    if fp8_scores and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_scores needs an FP8 key cache, got {k_cache.dtype}")


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
def _softmax_step(qk, seen, m_i, qk_scale, cap_log2, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
                  ROW_SCALED: tl.constexpr):  # fmt: skip
    """One chunk's online-softmax update of the raw score dots `qk` [BLOCK_M, BLOCK_N]: (the new
    running max, the old state's rescale factor, the chunk's weights), in log2 units. MASKED:
    keys outside `seen` weigh 0. ROW_SCALED: qk_scale is [BLOCK_M, 1] (the FP8 score dot's row
    scales), else a scalar. Without a soft-cap or row scales, the max is taken over the raw dots
    (the scale is positive) and each weight is exp2 of one FMA, qk * scale - max: a chunk's
    scaling then costs no instructions of its own (a 128-key chunk's loop body had 64 FMULs a
    thread for it, of about 1,000)."""
    if SOFTCAP or ROW_SCALED:
        s = _scores(qk, qk_scale, cap_log2, SOFTCAP)
        if MASKED:
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:
        if MASKED:
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    return m_new, tl.exp2(m_i - m_new), p


@triton.jit
def _prefix_chunk(
    q, k_cache_ptr, v_cache_ptr, idx_ptr, n0, num_prefix, kc_head, vc_head, kc_stride_s,
    vc_stride_s, m_i, l_i, acc, qk_scale, cap_log2,
    D: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr,
    F16: tl.constexpr, FP8_QK: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Fold prompt slots [n0, n0 + BLOCK_N) into the running (max, sum, accumulator). MASKED:
    the chunk crosses `num_prefix` (the range's end); a whole chunk loads and scores without
    masks (their per-key index arithmetic and compares were a quarter of the loop body's
    instructions). FP8_QK: q holds e4m3 codes and the keys enter the score dot as loaded
    (qk_scale carries each row's scale)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if MASKED:
        mask_n = offs_n < num_prefix
        seen = mask_n[None, :]
        slots = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_ptrs = k_cache_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        seen = None
        slots = tl.load(idx_ptr + offs_n).to(tl.int64)
        k = tl.load(k_cache_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :])
    if not FP8_QK:
        k = _operand(k, F16, INTERPRET)
    m_new, alpha, p = _softmax_step(tl.dot(q, tl.trans(k)), seen, m_i, qk_scale, cap_log2,
                                    SOFTCAP, MASKED, FP8_QK)  # fmt: skip
    v_ptrs = v_cache_ptr + vc_head + slots[:, None] * vc_stride_s + offs_d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(_operand(p, F16, INTERPRET), _operand(v, F16, INTERPRET))
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _suffix_slot(
    q, k_cache_ptr, v_cache_ptr, slot_ptrs, mask_m, kc_head, vc_head, kc_stride_s, vc_stride_s,
    m_i, l_i, acc, qk_scale, cap_log2, D: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Fold one own slot per packed row (each row its own K/V vector) into the running state.
    A negative slot is no slot: rows of a shallower wave in a merged step have fewer own slots
    than the suffix's width, and their unused columns hold -1 (weight 0, nothing loaded)."""
    offs_d = tl.arange(0, D)
    slots = tl.load(slot_ptrs, mask=mask_m, other=-1).to(tl.int64)  # [BLOCK_M]
    used = slots >= 0
    slots = tl.where(used, slots, 0)
    k = tl.load(k_cache_ptr + kc_head + slots[:, None] * kc_stride_s + offs_d[None, :],
                mask=used[:, None], other=0.0)  # fmt: skip
    s = _scores(tl.sum(q * k.to(tl.float32), axis=1), qk_scale, cap_log2, SOFTCAP)  # [BLOCK_M]
    s = tl.where(used, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    v = tl.load(v_cache_ptr + vc_head + slots[:, None] * vc_stride_s + offs_d[None, :],
                mask=used[:, None], other=0.0)  # fmt: skip
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
    return m_new, l_i * alpha + p, acc


@triton.jit
def _beam_cascade_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, prefix_indptr_ptr, prefix_idx_ptr, row_indptr_ptr,
    suffix_ptr, o_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    q_stride_r, q_stride_h, kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h,
    sfx_stride_r, sfx_stride_s, o_stride_r, o_stride_h, part_stride_split, qk_scale, cap_log2,
    GROUP: tl.constexpr, S: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr, F16: tl.constexpr, FP8_QK: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
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
    if FP8_QK:  # each packed row's e4m3 codes; its scale folded into the score scales
        q_dot, row_scale = _fp8_query_rows(q)
        chunk_scale, slot_scale = qk_scale * row_scale[:, None], qk_scale * row_scale
    else:
        q_dot = _query_operand(q, F16, INTERPRET)
        chunk_scale, slot_scale = qk_scale, qk_scale

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kc_head, vc_head = kv_head.to(tl.int64) * kc_stride_h, kv_head.to(tl.int64) * vc_stride_h
    # The rows' own slots first (split 0's program), so the bf16 query tile they score is dead
    # before the prompt loop: kept live across it beside the dot's operand, it made the
    # registers spill around the loop (248-616 bytes a thread, sm_90).
    if split == 0:
        if FP8_QK:  # the own slots score the rounded queries the prompt's dot saw
            q_f32 = q_dot.to(tl.float32)
        else:
            q_f32 = q.to(tl.float32)
        for j in tl.static_range(S):
            slot_ptrs = suffix_ptr + rows * sfx_stride_r + j * sfx_stride_s
            m_i, l_i, acc = _suffix_slot(
                q_f32, k_cache_ptr, v_cache_ptr, slot_ptrs, mask_m, kc_head, vc_head,
                kc_stride_s, vc_stride_s, m_i, l_i, acc, slot_scale, cap_log2, D, SOFTCAP,
            )  # fmt: skip
    prefix_start = tl.load(prefix_indptr_ptr + req)
    num_prefix = tl.load(prefix_indptr_ptr + req + 1) - prefix_start
    # this program's prompt range [lo, hi): whole BLOCK_N chunks, the last split the remainder
    per_split = tl.cdiv(tl.cdiv(num_prefix, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.maximum(tl.minimum(lo + per_split, num_prefix), lo)  # a split past the prompt: empty
    idx_ptr = prefix_idx_ptr + prefix_start
    full = lo + (hi - lo) // BLOCK_N * BLOCK_N  # whole chunks [lo, full), then at most one part
    if INTERPRET:
        # The interpreter cannot take a loaded scalar as a range() bound (int() of a 1-element
        # array fails under numpy >= 2.4); a while loop only needs its truth value.
        n0 = lo
        while n0 < full:
            m_i, l_i, acc = _prefix_chunk(
                q_dot, k_cache_ptr, v_cache_ptr, idx_ptr, n0, hi, kc_head, vc_head,
                kc_stride_s, vc_stride_s, m_i, l_i, acc, chunk_scale, cap_log2, D, BLOCK_N,
                INTERPRET, SOFTCAP, F16, FP8_QK, False,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(lo, full, BLOCK_N):  # a for loop, so the compiler pipelines loads
            m_i, l_i, acc = _prefix_chunk(
                q_dot, k_cache_ptr, v_cache_ptr, idx_ptr, n0, hi, kc_head, vc_head,
                kc_stride_s, vc_stride_s, m_i, l_i, acc, chunk_scale, cap_log2, D, BLOCK_N,
                INTERPRET, SOFTCAP, F16, FP8_QK, False,
            )  # fmt: skip
    if full < hi:
        m_i, l_i, acc = _prefix_chunk(
            q_dot, k_cache_ptr, v_cache_ptr, idx_ptr, full, hi, kc_head, vc_head,
            kc_stride_s, vc_stride_s, m_i, l_i, acc, chunk_scale, cap_log2, D, BLOCK_N,
            INTERPRET, SOFTCAP, F16, FP8_QK, True,
        )  # fmt: skip

    if SPLITS == 1:
        o = acc / l_i[:, None]
        o_ptrs = o_ptr + rows[:, None] * o_stride_r + heads[:, None] * o_stride_h + offs_d[None, :]
        tl.store(o_ptrs, cast_for_store(o, o_ptr.dtype.element_ty), mask=mask_m[:, None])
    else:  # partials [SPLITS, R, HQ(, D)], contiguous
        packed = split * part_stride_split + rows * HQ + heads  # [BLOCK_M] (row, head) index
        tl.store(part_m_ptr + packed, m_i, mask=mask_m)
        tl.store(part_l_ptr + packed, l_i, mask=mask_m)
        acc_ptrs = part_acc_ptr + packed[:, None] * D + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=mask_m[:, None])


@triton.jit
def _merge_splits_kernel(
    row_indptr_ptr, o_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    o_stride_r, o_stride_h, part_stride_split,
    GROUP: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """Combine the splits' partials of one (request, kv head, tile), the attention kernel's
    packing of rows and heads, and store bf16: o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    row_start = tl.load(row_indptr_ptr + req)
    num_packed = (tl.load(row_indptr_ptr + req + 1) - row_start) * GROUP
    if tile * BLOCK_M >= num_packed:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_packed
    rows = (row_start + offs_m // GROUP).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, D)
    m_all = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for split in tl.static_range(SPLITS):
        packed = split * part_stride_split + rows * HQ + heads
        m_s = tl.load(part_m_ptr + packed, mask=mask_m, other=_M_INIT)
        l_s = tl.load(part_l_ptr + packed, mask=mask_m, other=0.0)
        acc_s = tl.load(part_acc_ptr + packed[:, None] * D + offs_d[None, :], mask=mask_m[:, None])
        m_new = tl.maximum(m_all, m_s)
        alpha, beta = tl.exp2(m_all - m_new), tl.exp2(m_s - m_new)
        l_all = l_all * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_all = m_new
    o = acc / l_all[:, None]
    o_ptrs = o_ptr + rows[:, None] * o_stride_r + heads[:, None] * o_stride_h + offs_d[None, :]
    tl.store(o_ptrs, cast_for_store(o, o_ptr.dtype.element_ty), mask=mask_m[:, None])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _shared_memory_per_block(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def unsplit_stages(k_cache: torch.Tensor) -> int:
    """Pipeline depth of an unsplit launch: 5 over an FP8 cache on a GPU with the shared memory
    for it, else `UNSPLIT_LAUNCH`'s 3. From 5 stages Triton 3.6 gives K and V two shared-memory
    buffers each, so a chunk's copies overlap the previous chunk's dots (at 3-4, one each:
    `flashrec_kernels.gpu_compile.loop_schedule`); on an H100 that took 2-7% off every shape
    of scripts/bench_attention.py (docs/benchmarks.md, session 36). A bf16 cache keeps 3: 5
    would take 230 KB, unmeasured, and more than an A100 has."""
    if k_cache.device.type != "cuda" or k_cache.element_size() != 1:
        return UNSPLIT_LAUNCH["num_stages"]
    index = k_cache.device.index if k_cache.device.index is not None else 0
    fits = _shared_memory_per_block(index) >= FIVE_STAGE_SHARED_BYTES
    return 5 if fits else UNSPLIT_LAUNCH["num_stages"]


def auto_num_splits(programs: int, device: torch.device) -> int:
    """Prompt splits for a launch of `programs` (request, kv head, tile) programs: the largest
    power of two up to MAX_SPLITS that keeps the grid within the GPU's SMs, 1 once the grid
    alone fills them (then splitting only adds a merge) and off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    spare = _sm_count(device.index if device.index is not None else 0) // max(programs, 1)
    return 1 if spare < 2 else min(MAX_SPLITS, 1 << (spare.bit_length() - 1))


def split_partials(
    num_splits: int, q: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp32 partials (accumulator [splits, R, Hq, D], running max and sum [splits, R, Hq])
    of a launch of `num_splits` splits over q's rows, for `_merge_splits_kernel`; in a graph,
    memory of the graph's pool. One split needs none: `out` stands in, unused. Raises on a
    count that is not a power of two up to MAX_SPLITS."""
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(
            f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}"
        )
    if num_splits == 1:
        return out, out, out
    rows, heads, head_dim = q.shape
    part_m = torch.empty((num_splits, rows, heads), device=q.device)
    acc = torch.empty((num_splits, rows, heads, head_dim), device=q.device)
    return acc, part_m, torch.empty_like(part_m)


def merge_splits(
    row_indptr: torch.Tensor,
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_kv_heads: int,
    max_rows_per_group: int,
    num_splits: int,
) -> None:
    """Launch `_merge_splits_kernel` over `split_partials`' buffers into `out` [R, Hq, D]: one
    program per (row group of `row_indptr`, kv head, tile of packed rows); `max_rows_per_group`
    bounds a group's rows (the grid is static)."""
    part_acc, part_m, part_l = partials
    num_rows, num_q_heads, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    merge_tiles = triton.cdiv(max_rows_per_group * group, MERGE_BLOCK_M)
    _merge_splits_kernel[(row_indptr.numel() - 1, num_kv_heads, merge_tiles)](
        row_indptr, out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
        num_rows * num_q_heads,
        GROUP=group, D=head_dim, HQ=num_q_heads, BLOCK_M=MERGE_BLOCK_M, SPLITS=num_splits,
        num_warps=4,
    )  # fmt: skip


def score_scales(sm_scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2) of `_scores`: log2(e) folded into the scale, or with a soft-cap,
    sm_scale / cap and cap * log2(e)."""
    if logit_softcap is None:
        return sm_scale * _LOG2E, 0.0
    return sm_scale / logit_softcap, logit_softcap * _LOG2E


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
    block_n: int | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,
    f16_dots: bool | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    fp8_scores: bool = False,
) -> None:
    """Launch the (B, Hkv, tiles x splits) grid, and the merge when splits > 1; arguments are
    validated by the public wrapper.

    block_m / block_n override the tile shape (tests use small tiles to cover several tiles and
    chunks at interpreter-friendly sizes; benchmarks, with num_warps / num_stages, other
    launches; unset, block_n and num_stages follow the split count, see the tuning knobs);
    num_splits overrides `auto_num_splits` (a power of two, at most MAX_SPLITS);
    f16_dots the dots' operand type (default: as `use_f16_dots` decides).

    fp8_scores (an experiment, off by default; `EngineConfig.fp8_attention_scores` and
    scripts/bench_attention.py turn it on): the prompt chunks' score dot on FP8 tensor cores,
    each packed query row quantized in the kernel to e4m3 with its own scale (amax / 448) and
    the FP8 keys taken as loaded; the own slots score the same rounded queries. Queries keep 4
    significant bits instead of 8. Needs an FP8 cache.
    """
    check_fp8_scores(k_cache, fp8_scores)
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_m = BLOCK_M[min(max(head_dim, 64), 256)] if block_m is None else block_m
    num_tiles = triton.cdiv(max_rows_per_request * group, block_m)
    if num_rows == 0:
        return
    num_requests = row_indptr.numel() - 1
    if num_splits is None:
        num_splits = auto_num_splits(num_requests * num_kv_heads * num_tiles, q.device)
    wide = num_splits == 1 and head_dim <= 128
    if block_n is None:
        block_n = UNSPLIT_LAUNCH["block_n"] if wide else BLOCK_N
    if num_stages is None:
        num_stages = unsplit_stages(k_cache) if wide else NUM_STAGES
    part_acc, part_m, part_l = split_partials(num_splits, q, out)
    qk_scale, cap_log2 = score_scales(sm_scale, logit_softcap)
    grid = (num_requests, num_kv_heads, num_tiles * num_splits)
    _beam_cascade_attention_kernel[grid](
        q, k_cache, v_cache, prefix_indptr, prefix_indices, row_indptr, suffix, out,
        part_acc, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), suffix.stride(0), suffix.stride(1),
        out.stride(0), out.stride(1), num_rows * num_q_heads, qk_scale, cap_log2,
        GROUP=group, S=suffix.shape[1], D=head_dim, HQ=num_q_heads,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=num_splits, INTERPRET=triton_interpreting(),
        SOFTCAP=logit_softcap is not None,
        F16=use_f16_dots(k_cache, f16_dots), FP8_QK=fp8_scores,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(row_indptr, out, (part_acc, part_m, part_l), num_kv_heads,
                     max_rows_per_request, num_splits)  # fmt: skip
