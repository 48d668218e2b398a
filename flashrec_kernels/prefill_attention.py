"""Prefill attention over the paged KV pool: each sequence's new tokens attend, causally, to its slots.

Shapes (T new tokens of B sequences, page size 1):
    q           [T, Hq, D] bf16, unit stride on D (may be a view of the fused qkv buffer)
    k_cache     [num_slots, Hkv, D] bf16 or float8_e4m3fn (FP8 used as-is: no scale); v_cache alike
    qo_indptr   int32 [B + 1]; sequence b's queries are q[qo_indptr[b]:qo_indptr[b+1]]
    kv_indptr   int32 [B + 1]; its keys are the slots kv_indices[kv_indptr[b]:kv_indptr[b+1]], in
                position order, its own new tokens last (stored before attention runs)
    kv_indices  int32 [kv_indptr[B]]
    tiles       int32 [N, 2] from `prefill_tiles`: the (sequence, first packed row) of each program;
                rows with sequence -1 are spare programs (a CUDA graph's grid is fixed)
Query i of sequence b (kv_len keys, qo_len queries) sits at position p = kv_len - qo_len + i and
attends keys j <= p, and j > p - window with a sliding window:
    o[t, h] = softmax_j(cap(sm_scale * q[t, h] . k[j])) @ v[j]
with cap(s) = s, or logit_softcap * tanh(s / logit_softcap); computed in fp32 (the kernel's dots
take fp16 operands over an FP8 cache, bf16 over a bf16 one, and accumulate in fp32), rounded to
bf16. This is FlashInfer's causal paged prefill (BatchPrefillWithPagedKVCacheWrapper) with the
same inputs.

Why a kernel of our own: FlashInfer 0.6.13 has no sm90 prefill for bf16 queries over an FP8 cache,
so prompts ran through its FA2 kernel at a small fraction of the tensor-core peak, plus a split-KV
merge that cost more than the attention (docs/benchmarks.md). This one packs the GQA group into
the query tile (as `beam_cascade_attention` does) and skips the keys the causal mask hides.
"""

from __future__ import annotations

import numpy as np
import torch

from .beam_attention import _check_q_and_caches, _check_softcap, attention_output
from .device import check_triton_device

__all__ = [
    "check_prefill_attention_args",
    "prefill_attention",
    "prefill_attention_ref",
    "prefill_tile_capacity",
    "prefill_tiles",
]

_KERNEL = "prefill_attention"
_INDEX_DTYPE = torch.int32


def _fail(msg: str) -> None:
    raise ValueError(f"{_KERNEL}: {msg}")


def prefill_block_m(head_dim: int) -> int:
    """Packed (token, q head) rows per program: 128 up to head_dim 128, 64 above (the fp32
    accumulator [BLOCK_M, D] must fit the registers of 8 warps)."""
    return 128 if head_dim <= 128 else 64


def prefill_tile_capacity(num_tokens: int, num_sequences: int, group: int, block_m: int) -> int:
    """Most tiles a prefill of `num_tokens` tokens over `num_sequences` sequences can need: each
    sequence's packed rows round up to whole tiles (a CUDA graph sizes its tile map by this)."""
    return -(-num_tokens * group // block_m) + num_sequences


def prefill_tiles(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    group: int,
    block_m: int,
    capacity: int | None = None,
) -> torch.Tensor:
    """The tile map of one prefill (host int64 indptrs in, host int32 [N, 2] out).

    One row per program: (sequence, first packed row), packed row m of a sequence being token
    m // group, q head kv_head * group + m % group. Tiles are ordered by how many keys they read,
    most first: under the causal mask the last tile of a long prompt reads all of it and the
    first only its start, and the GPU runs the grid in order, so the long ones start first.
    `capacity` pads the map with (-1, 0) rows (spare programs) to a fixed length."""
    qo = np.asarray(qo_indptr, dtype=np.int64)  # host tensors convert without a copy
    kv = np.asarray(kv_indptr, dtype=np.int64)
    qo_len, kv_len = np.diff(qo), np.diff(kv)
    per_seq = -(-qo_len * group // block_m)  # tiles of each sequence
    seq = np.repeat(np.arange(qo_len.size), per_seq)
    first = np.cumsum(per_seq) - per_seq
    start = (np.arange(seq.size) - np.repeat(first, per_seq)) * block_m
    last = np.minimum(qo_len[seq], (start + block_m - 1) // group + 1)  # tokens up to this one
    order = np.argsort(-(kv_len[seq] - qo_len[seq] + last), kind="stable")  # keys read
    rows = seq.size if capacity is None else capacity
    if rows < seq.size:
        _fail(f"{seq.size} tiles exceed the tile map's capacity {capacity}")
    tiles = np.zeros((rows, 2), dtype=np.int32)
    tiles[:, 0] = -1
    tiles[: seq.size, 0], tiles[: seq.size, 1] = seq[order], start[order]
    return torch.from_numpy(tiles)


def check_prefill_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: torch.Tensor | None = None,
) -> None:
    """Validate shapes and dtypes only (no device reads, so it is safe inside a CUDA graph);
    `tiles` too when given (the kernel's, not the reference's)."""
    _check_q_and_caches(q, k_cache, v_cache)
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        if t.dim() != 1 or t.numel() < 2 or t.dtype != _INDEX_DTYPE:
            _fail(f"{name} must be int32 [B + 1] with B >= 1, got {t.dtype} {tuple(t.shape)}")
    if qo_indptr.shape != kv_indptr.shape:
        _fail(f"qo_indptr {tuple(qo_indptr.shape)} and kv_indptr {tuple(kv_indptr.shape)} differ")
    if kv_indices.dim() != 1 or kv_indices.dtype != _INDEX_DTYPE:
        _fail(f"kv_indices must be int32 [N], got {kv_indices.dtype} {tuple(kv_indices.shape)}")
    if tiles is not None and (
        tiles.dim() != 2 or tiles.shape[1] != 2 or tiles.dtype != _INDEX_DTYPE
    ):
        _fail(f"tiles must be int32 [N, 2] (from prefill_tiles), got {tiles.dtype} {tiles.shape}")


def _check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        _fail(f"window must be None or a positive int, got {window!r}")


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    logit_softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Torch reference (fp32 math, a host loop over sequences): o [T, Hq, D] bf16; tokens outside
    [qo_indptr[0], qo_indptr[B]) are zero."""
    check_prefill_attention_args(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)
    _check_softcap(logit_softcap)
    _check_window(window)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qo_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if qo_len > kv_len:
            _fail(f"sequence {b} has {qo_len} queries but only {kv_len} keys")
        if qo_len == 0:
            continue
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,jhd->htj", q[qo[b] : qo[b + 1]].float(), keys) * sm_scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        pos = torch.arange(kv_len - qo_len, kv_len, device=q.device)[:, None]
        j = torch.arange(kv_len, device=q.device)[None, :]
        hidden = j > pos
        if window is not None:
            hidden |= j <= pos - window
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[qo[b] : qo[b + 1]] = torch.einsum("htj,jhd->thd", probs, values).to(torch.bfloat16)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    fp8_scores: bool = False,
) -> torch.Tensor:
    """Triton version of `prefill_attention_ref`; no host syncs, so it captures in a graph.

    `tiles` is `prefill_tiles(...)` of the same indptrs and `block_m` (default
    `prefill_block_m(D)`), on q's device; one program per tile and kv head. Tokens no tile
    covers are not written. `out` ([T, Hq, D] bf16, contiguous) lets a graph keep its output
    buffer. block_m / block_n override the tile shape (tests, benchmarks). `num_splits` cuts
    each tile's keys into that many ranges run in parallel and merged (a power of two up to
    16); by default it follows from the grid and the GPU's SMs, so a prefill of a few tokens
    over a long cached prompt still fills the GPU. `fp8_scores` (experimental, an FP8 cache
    only): the score dot on FP8 operands, each query row rounded to e4m3 under its own scale
    (`launch_prefill_attention`)."""
    check_prefill_attention_args(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, tiles)
    _check_softcap(logit_softcap)
    _check_window(window)
    check_triton_device(q, _KERNEL)
    out = attention_output(q, out, _KERNEL)
    from .triton_prefill_attention import launch_prefill_attention

    launch_prefill_attention(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, tiles, sm_scale, out,
        logit_softcap=logit_softcap, window=window,
        block_m=prefill_block_m(q.shape[2]) if block_m is None else block_m, block_n=block_n,
        num_splits=num_splits, fp8_scores=fp8_scores,
    )  # fmt: skip
    return out
