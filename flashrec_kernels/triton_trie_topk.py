"""Triton kernel of `trie_topk`: one program per row, a running top-k over chunks of child slots.

Each chunk of CHUNK slots is scored and packed into unique int64 keys (see trie_topk.py), reduced
to its best K_PAD with `tl.topk` (bitonic top-k), and merged into the running best K_PAD: the
elementwise max of a descending and an ascending sorted run holds the K_PAD largest of both and
is bitonic, so one bitonic merge sorts it. The cost is about W * log2(K_PAD)^2 / 4
compare-exchanges per row, whatever the chunking; CHUNK only bounds registers. No host sync and
no data-dependent shapes: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .trie_topk import CsrLevel, DenseLevel, TrieTopK, level_width

__all__ = ["launch_trie_topk"]

_MAX_CHUNK = 2048
_MIN_K_PAD = 16


@triton.jit
def _low_mask(like):
    """0xFFFFFFFF as int64, shaped like `like` (a bare literal would be typed uint32)."""
    return (tl.full(like.shape, 1, tl.int64) << 32) - 1


@triton.jit
def _pack(key, j):
    key = tl.where(key == 0.0, 0.0, key)  # -0.0 ranks as +0.0, as in torch's comparisons
    bits = key.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    low = _low_mask(ordered)
    return (ordered << 32) | (low - j.to(tl.int64))


@triton.jit
def _unpack(packed):
    ordered = (packed >> 32).to(tl.int32)  # arithmetic shift: the sign of the key survives
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    low = _low_mask(packed)
    return bits.to(tl.float32, bitcast=True), low - (packed & low)


@triton.jit
def _slot_codes(j, node, table_ptr, start, end, codes_ptr, W: tl.constexpr, DENSE: tl.constexpr):
    """(valid, code, at) of slots j of one row: `at` is the child id (dense, -1 if absent) or the
    edge index (CSR)."""
    in_row = j < W
    if DENSE:
        at = tl.load(table_ptr + node * W + j, mask=in_row, other=-1)
        valid = at >= 0
        code = j.to(tl.int64)
    else:
        at = start + j
        valid = in_row & (at < end)
        code = tl.load(codes_ptr + at, mask=valid, other=0).to(tl.int64)
    return valid, code, at


@triton.jit
def _chunk_top(
    c, node, parent, lp_row, noise_row, table_ptr, start, end, codes_ptr,
    W: tl.constexpr, DENSE: tl.constexpr, HAS_NOISE: tl.constexpr,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    """The K_PAD best packed keys of slots c*CHUNK .. (c+1)*CHUNK-1, descending."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    valid, code, _ = _slot_codes(j, node, table_ptr, start, end, codes_ptr, W, DENSE)
    key = parent + tl.load(lp_row + code, mask=valid, other=0.0)
    if HAS_NOISE:
        key = key + tl.load(noise_row + j, mask=j < W, other=0.0)
    # Slots past W are invalid too: -inf with j >= W ranks after every real slot.
    return tl.topk(_pack(tl.where(valid, key, float("-inf")), j), K_PAD)


@triton.jit
def _trie_topk_kernel(
    nodes_ptr, parent_ptr, lp_ptr, lp_row_stride, noise_ptr,
    table_ptr, indptr_ptr, codes_ptr, ids_ptr,
    key_ptr, pos_ptr, score_ptr, code_ptr, child_ptr, k,
    W: tl.constexpr, DENSE: tl.constexpr, HAS_NOISE: tl.constexpr,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    node = tl.load(nodes_ptr + row)
    parent = tl.load(parent_ptr + row)
    if DENSE:
        start = node * 0
        end = start
    else:
        start = tl.load(indptr_ptr + node)
        end = tl.load(indptr_ptr + node + 1)
    lp_row = lp_ptr + row * lp_row_stride
    noise_row = noise_ptr + row * W
    best = _chunk_top(0, node, parent, lp_row, noise_row, table_ptr, start, end, codes_ptr,
                      W, DENSE, HAS_NOISE, CHUNK, K_PAD)  # fmt: skip
    NUM_CHUNKS: tl.constexpr = (W + CHUNK - 1) // CHUNK
    for c in range(1, NUM_CHUNKS):
        top = _chunk_top(c, node, parent, lp_row, noise_row, table_ptr, start, end, codes_ptr,
                         W, DENSE, HAS_NOISE, CHUNK, K_PAD)  # fmt: skip
        # max(descending, ascending) = the K_PAD best of both, as one bitonic run
        best = tl.bitonic_merge(tl.maximum(best, tl.flip(top, 0)), descending=True)
    key, j = _unpack(best)
    rank = tl.arange(0, K_PAD)
    out = row * k + rank
    keep = rank < k
    # Gather what selection needs at the chosen slots; only keys live in the loop above.
    valid, code, at = _slot_codes(j, node, table_ptr, start, end, codes_ptr, W, DENSE)
    if DENSE:
        child = tl.maximum(at, 0).to(tl.int64)
    else:
        child = tl.load(ids_ptr + at, mask=valid & keep, other=0).to(tl.int64)
    lp = tl.load(lp_row + code, mask=valid & keep, other=0.0)
    tl.store(pos_ptr + out, j, mask=keep)
    tl.store(score_ptr + out, tl.where(valid, parent + lp, float("-inf")), mask=keep)
    tl.store(code_ptr + out, code, mask=keep)
    tl.store(child_ptr + out, child, mask=keep)
    if HAS_NOISE:
        tl.store(key_ptr + out, key, mask=keep)


def launch_trie_topk(
    level: DenseLevel | CsrLevel,
    nodes: torch.Tensor,
    parent_score: torch.Tensor,
    log_probs: torch.Tensor,
    k: int,
    noise: torch.Tensor | None,
) -> TrieTopK:
    """Launch one program per row; arguments are validated by the public wrapper."""
    rows, width, dev = nodes.shape[0], level_width(level), log_probs.device
    score = torch.empty((rows, k), dtype=torch.float32, device=dev)
    key = score if noise is None else torch.empty_like(score)
    pos, code, child = (torch.empty((rows, k), dtype=torch.int64, device=dev) for _ in range(3))
    if rows == 0:
        return TrieTopK(key, pos, score, code, child)
    k_pad = max(triton.next_power_of_2(k), _MIN_K_PAD)
    chunk = max(k_pad, min(triton.next_power_of_2(width), _MAX_CHUNK))
    if log_probs.stride(1) != 1:
        log_probs = log_probs.contiguous()
    dense = isinstance(level, DenseLevel)
    tables = (level.table,) * 4 if dense else (level.indptr, level.indptr, level.codes, level.ids)
    _trie_topk_kernel[(rows,)](
        nodes.contiguous(), parent_score.contiguous(), log_probs, log_probs.stride(0),
        score if noise is None else noise.contiguous(), *tables,
        key, pos, score, code, child, k,
        W=width, DENSE=dense, HAS_NOISE=noise is not None, CHUNK=chunk, K_PAD=k_pad,
        num_warps=min(max(chunk // 256, 1), 8),
    )  # fmt: skip
    return TrieTopK(key, pos, score, code, child)
