"""Trie mask + score + per-row top-k: the first stage of constrained beam selection, fused.

Row r (parent node `nodes[r]` at some trie level) has W child slots j = 0 .. W-1:

| trie  | slot j is valid when                  | code_j                      | child_j            |
| ----- | ------------------------------------- | --------------------------- | ------------------ |
| dense | table[node, j] >= 0                   | j                           | table[node, j]     |
| CSR   | indptr[node] + j < indptr[node + 1]   | codes[indptr[node] + j]     | ids[indptr[node] + j] |

score_j = parent_score[r] + log_probs[r, code_j] (-inf when invalid) and key_j = score_j
(+ noise[r, j]). The k best keys come back best first; equal keys rank the lower slot j first,
which is what a stable descending sort gives. Order is by the int64 "packed key"
(order-preserving int32 of the fp32 key) << 32 | (0xFFFFFFFF - j): unique per row, so a plain
top-k on it is deterministic and needs no sort. Keys must not be NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .device import check_triton_device

__all__ = [
    "CsrLevel",
    "DenseLevel",
    "TrieTopK",
    "pack_keys",
    "stable_topk",
    "trie_topk",
    "trie_topk_ref",
]

_KERNEL = "trie_topk"
_LOW = 0xFFFFFFFF


class DenseLevel(NamedTuple):
    """One dense trie level: child ids int32 [num_nodes, K], -1 where code j is absent; W = K."""

    table: torch.Tensor


class CsrLevel(NamedTuple):
    """One CSR trie level: node v's children are edges indptr[v] .. indptr[v+1]-1, by code."""

    indptr: torch.Tensor  # int64 [num_nodes + 1]
    codes: torch.Tensor  # int32 [edges]
    ids: torch.Tensor  # int32 [edges] child node ids
    width: int  # W: the largest degree


class TrieTopK(NamedTuple):
    """The k best child slots of each row, best first; every field is [R, k].

    Everything beam selection gathers afterwards is here, so it never touches an [R, W] tensor.
    Invalid slots (only chosen when a row has fewer than k valid children) have key and score
    -inf, child 0, and code j (dense) or 0 (CSR), as `Trie.children` pads.
    """

    key: torch.Tensor  # fp32 selection key: score + noise (the same tensor as score without noise)
    pos: torch.Tensor  # int64 slot j in [0, W)
    score: torch.Tensor  # fp32 parent_score + log-prob, without noise
    code: torch.Tensor  # int64 code of the child (its column of log_probs)
    child: torch.Tensor  # int64 child node id at the next level


def level_width(level: DenseLevel | CsrLevel) -> int:
    """W, the number of child slots per row."""
    return level.table.shape[1] if isinstance(level, DenseLevel) else level.width


def pack_keys(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like `keys` (fp32) along the last dim, ties by lower index first."""
    assert keys.dtype == torch.float32, f"packs fp32 keys, got {keys.dtype}"
    bits = torch.where(keys == 0, 0.0, keys).view(torch.int32).long()  # -0.0 ranks as +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # sign-magnitude -> two's complement
    index = torch.arange(keys.shape[-1], device=keys.device)
    return (ordered << 32) | (_LOW - index)


def stable_topk(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of fp32 `keys` along the last dim, descending; equal keys keep index order.

    Equals `torch.sort(keys, descending=True, stable=True)[..., :k]` at a top-k's cost.
    """
    index = _LOW - (torch.topk(pack_keys(keys), k, dim=-1).values & _LOW)
    return keys.gather(-1, index), index


def _check_args(
    level: DenseLevel | CsrLevel,
    nodes: torch.Tensor,
    parent_score: torch.Tensor,
    log_probs: torch.Tensor,
    k: int,
    noise: torch.Tensor | None,
) -> None:
    rows, width = nodes.shape[0], level_width(level)
    if nodes.dtype != torch.int64 or nodes.dim() != 1:
        raise ValueError(
            f"{_KERNEL}: nodes must be int64 [R], got {nodes.dtype}{list(nodes.shape)}"
        )
    for name, t, shape in (
        ("parent_score", parent_score, (rows,)),
        ("log_probs", log_probs, (rows, log_probs.shape[-1])),
        ("noise", noise, (rows, width)),
    ):
        if t is not None and (t.dtype != torch.float32 or t.shape != shape):
            raise ValueError(
                f"{_KERNEL}: {name} must be fp32 {list(shape)}, got {t.dtype}{list(t.shape)}"
            )
    if isinstance(level, DenseLevel) and level.table.shape[1] != log_probs.shape[1]:
        raise ValueError(
            f"{_KERNEL}: dense table has {level.table.shape[1]} codes, log_probs "
            f"{log_probs.shape[1]}; they must be the same level"
        )
    if not 1 <= k <= width:
        raise ValueError(f"{_KERNEL}: k must be in 1..W={width}, got {k}")


def _children(
    level: DenseLevel | CsrLevel, nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, child, valid) [R, W] of every slot, padded like `Trie.children`."""
    if isinstance(level, DenseLevel):
        child = level.table[nodes].long()
        codes = torch.arange(child.shape[1], device=child.device).expand_as(child)
        return codes, child.clamp_min(0), child >= 0
    idx = level.indptr[nodes][:, None] + torch.arange(level.width, device=nodes.device)
    valid = idx < level.indptr[nodes + 1][:, None]
    idx = idx.masked_fill(~valid, 0)
    codes = level.codes[idx].long().masked_fill(~valid, 0)
    return codes, level.ids[idx].long().masked_fill(~valid, 0), valid


def trie_topk_ref(
    level: DenseLevel | CsrLevel,
    nodes: torch.Tensor,
    parent_score: torch.Tensor,
    log_probs: torch.Tensor,
    k: int,
    noise: torch.Tensor | None = None,
) -> TrieTopK:
    """nodes int64 [R], parent_score fp32 [R], log_probs fp32 [R, K], noise fp32 [R, W] or None
    -> the k best child slots of each row (see the module docstring)."""
    _check_args(level, nodes, parent_score, log_probs, k, noise)
    codes, child, valid = _children(level, nodes)
    step = log_probs.gather(1, codes).masked_fill(~valid, float("-inf"))
    scores = parent_score[:, None] + step  # [R, W]
    keys = scores if noise is None else scores + noise
    key, pos = stable_topk(keys, k)
    score = key if noise is None else scores.gather(1, pos)
    return TrieTopK(key, pos, score, codes.gather(1, pos), child.gather(1, pos))


def trie_topk(
    level: DenseLevel | CsrLevel,
    nodes: torch.Tensor,
    parent_score: torch.Tensor,
    log_probs: torch.Tensor,
    k: int,
    noise: torch.Tensor | None = None,
) -> TrieTopK:
    """Triton version of `trie_topk_ref`: one program per row, no host sync, static shapes."""
    _check_args(level, nodes, parent_score, log_probs, k, noise)
    check_triton_device(log_probs, _KERNEL)
    from .triton_trie_topk import launch_trie_topk

    return launch_trie_topk(level, nodes, parent_score, log_probs, k, noise)
