"""The catalog trie that constrains beam search to SIDs that exist.

Node numbering (shared by both representations):

| level d        | node ids                                                        |
| -------------- | --------------------------------------------------------------- |
| 0              | 0 (the root, the empty prefix)                                  |
| 1 .. depth-1   | distinct prefixes of length d, numbered in lexicographic order  |
| depth (leaves) | catalog row index (Catalog.codes is sorted, so rows are leaves) |

The decode path reads each level's fixed-width tables (`kernel_level`) through the trie top-k
kernel or its reference: no host sync, no data-dependent shapes, so one decode step including
the trie mask can be captured in a CUDA graph. `children(level, nodes)` materializes the same
padded view for tests and tools.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

from flashrec_kernels import CsrLevel, DenseLevel

logger = logging.getLogger(__name__)


class TrieError(ValueError):
    """The SIDs given to build a trie are empty, duplicated or out of range."""


class TrieChildren(NamedTuple):
    """Children of a batch of nodes, padded to the level's width W, ascending by code.

    Invalid entries have `child == 0` and a code in range (0 for CSR padding, the absent code
    for dense tables). `codes` may be a broadcast view: do not write to it in place.
    """

    codes: torch.Tensor  # int64 [rows, W]
    child: torch.Tensor  # int64 [rows, W] node ids at level + 1 (catalog rows at the last level)
    valid: torch.Tensor  # bool [rows, W]


class Trie(ABC):
    """Catalog trie. The decode path reads `kernel_level` tables (the trie top-k kernel or its
    torch reference); `children` materializes one level's children for tests and tools."""

    def __init__(self, level_sizes: Sequence[int], num_nodes: Sequence[int], widths: Sequence[int]):
        assert len(num_nodes) == len(level_sizes) + 1 == len(widths) + 1, "one entry per level"
        self.level_sizes = tuple(int(k) for k in level_sizes)
        self._num_nodes = tuple(int(n) for n in num_nodes)
        self._widths = tuple(int(w) for w in widths)

    @property
    def depth(self) -> int:
        return len(self.level_sizes)

    @property
    def num_sids(self) -> int:
        return self._num_nodes[-1]

    def num_nodes(self, level: int) -> int:
        """Nodes at `level` (0 <= level <= depth); level 0 is the root, level depth the SIDs."""
        return self._num_nodes[level]

    def max_children(self, level: int) -> int:
        """Static width W of `children(level, ...)`."""
        return self._widths[level]

    def sid_index(self, child_ids: torch.Tensor) -> torch.Tensor:
        """Catalog row of last-level children: the identity, by the numbering above."""
        return child_ids

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def children(self, level: int, nodes: torch.Tensor) -> TrieChildren:
        """Children of `nodes` (int64 [rows], node ids at `level`, all valid) -> [rows, W]."""

    @abstractmethod
    def kernel_level(self, level: int) -> DenseLevel | CsrLevel:
        """The tables of `level` as `flashrec_kernels.trie_topk` reads them (views, no copy)."""

    @abstractmethod
    def to(self, device: torch.device | str) -> Trie: ...


class DenseTrie(Trie):
    """Per level a table next[num_nodes, K] of child ids, -1 where the code is absent."""

    def __init__(self, level_sizes: Sequence[int], tables: Sequence[torch.Tensor], num_sids: int):
        num_nodes = [t.shape[0] for t in tables] + [num_sids]
        super().__init__(level_sizes, num_nodes, [t.shape[1] for t in tables])
        self.tables = list(tables)  # int32 [num_nodes, K] per level, -1 where absent
        self._codes = [torch.arange(t.shape[1], device=t.device)[None, :] for t in tables]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables)

    def children(self, level: int, nodes: torch.Tensor) -> TrieChildren:
        child = self.tables[level][nodes].long()  # [rows, K]
        valid = child >= 0
        return TrieChildren(self._codes[level].expand_as(child), child.clamp_min_(0), valid)

    def kernel_level(self, level: int) -> DenseLevel:
        return DenseLevel(self.tables[level])

    def to(self, device: torch.device | str) -> DenseTrie:
        return DenseTrie(self.level_sizes, [t.to(device) for t in self.tables], self.num_sids)


class CsrTrie(Trie):
    """Per level CSR edges: children of node v are entries indptr[v] .. indptr[v+1]-1."""

    def __init__(
        self,
        level_sizes: Sequence[int],
        indptr: Sequence[torch.Tensor],
        child_codes: Sequence[torch.Tensor],
        child_ids: Sequence[torch.Tensor],
        widths: Sequence[int],
    ):
        num_nodes = [p.shape[0] - 1 for p in indptr] + [child_ids[-1].shape[0]]
        super().__init__(level_sizes, num_nodes, widths)
        self.indptr = list(indptr)  # int64 [num_nodes + 1] per level
        self.child_codes = list(child_codes)  # int32 [edges] per level
        self.child_ids = list(child_ids)  # int32 [edges] per level
        self._offsets = [torch.arange(w, device=p.device) for w, p in zip(widths, indptr)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._tables() for t in ts)

    def children(self, level: int, nodes: torch.Tensor) -> TrieChildren:
        indptr = self.indptr[level]
        idx = indptr[nodes][:, None] + self._offsets[level]  # [rows, W] edge index
        invalid = idx >= indptr[nodes + 1][:, None]
        idx = idx.masked_fill_(invalid, 0)  # every level has >= 1 edge, so 0 is safe
        codes = self.child_codes[level][idx].long().masked_fill_(invalid, 0)
        child = self.child_ids[level][idx].long().masked_fill_(invalid, 0)
        return TrieChildren(codes, child, ~invalid)

    def kernel_level(self, level: int) -> CsrLevel:
        width = self._widths[level]
        return CsrLevel(self.indptr[level], self.child_codes[level], self.child_ids[level], width)

    def to(self, device: torch.device | str) -> CsrTrie:
        indptr, codes, ids = ([t.to(device) for t in ts] for ts in self._tables())
        return CsrTrie(self.level_sizes, indptr, codes, ids, self._widths)

    def _tables(self) -> tuple[list[torch.Tensor], ...]:
        return self.indptr, self.child_codes, self.child_ids


class _Level(NamedTuple):
    """Edges from level d to d + 1, sorted by (parent, code)."""

    num_nodes: int  # nodes at level d
    parent: np.ndarray  # int64 [edges]
    code: np.ndarray  # int64 [edges]
    child: np.ndarray  # int64 [edges] node ids at level d + 1 (catalog rows at the last level)


def _sorted_sids(codes: np.ndarray, level_sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Validated SIDs in lexicographic order, and the input row of each."""
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 2 or codes.shape[0] == 0 or codes.shape[1] != len(level_sizes):
        raise TrieError(
            f"a trie needs a non-empty [num_sids, depth] code array with depth = "
            f"{len(level_sizes)} (one per level size), got shape {codes.shape}"
        )
    bad = (codes < 0) | (codes >= np.asarray(level_sizes, dtype=np.int64))
    if bad.any():
        row, lvl = (int(x) for x in np.argwhere(bad)[0])
        raise TrieError(
            f"SID row {row} has code {codes[row, lvl]} at level {lvl}, "
            f"expected 0..{level_sizes[lvl] - 1}"
        )
    order = np.lexsort(codes.T[::-1])
    return codes[order], order


def _trie_levels(codes: np.ndarray, level_sizes: Sequence[int]) -> list[_Level]:
    """Edges of every level, from one lexicographic sort (vectorized, O(N * depth))."""
    ordered, order = _sorted_sids(codes, level_sizes)
    n, depth = ordered.shape
    differs = np.ones((n, depth), dtype=bool)  # [n, depth] row i differs from row i-1 at level
    differs[1:] = ordered[1:] != ordered[:-1]
    opens = np.zeros(n, dtype=bool)  # row i opens a new prefix of length d
    opens[0] = True
    node = np.zeros(n, dtype=np.int64)  # node id of row i's prefix of length d
    levels = []
    for d in range(depth):
        opens |= differs[:, d]
        rows = np.flatnonzero(opens)
        next_node = np.cumsum(opens) - 1
        child = order[rows] if d == depth - 1 else next_node[rows]
        levels.append(_Level(int(node[-1]) + 1, node[rows], ordered[rows, d], child))
        node = next_node
    if not opens.all():
        j = int(np.argmin(opens))
        raise TrieError(
            f"SID {tuple(ordered[j].tolist())} appears twice (rows {order[j - 1]} and "
            f"{order[j]}); a trie needs unique SIDs, as in Catalog.codes"
        )
    return levels


def _dense_trie(levels: list[_Level], level_sizes: Sequence[int]) -> DenseTrie:
    tables = []
    for level, size in zip(levels, level_sizes, strict=True):
        table = np.full((level.num_nodes, size), -1, dtype=np.int32)
        table[level.parent, level.code] = level.child
        tables.append(torch.from_numpy(table))
    return DenseTrie(level_sizes, tables, len(levels[-1].child))


def _csr_trie(levels: list[_Level], level_sizes: Sequence[int]) -> CsrTrie:
    indptrs, widths = [], []
    for level in levels:
        degree = np.bincount(level.parent, minlength=level.num_nodes)
        indptr = np.zeros(level.num_nodes + 1, dtype=np.int64)
        np.cumsum(degree, out=indptr[1:])
        indptrs.append(torch.from_numpy(indptr))
        widths.append(int(degree.max()))
    codes = [torch.from_numpy(level.code.astype(np.int32)) for level in levels]
    child_ids = [torch.from_numpy(level.child.astype(np.int32)) for level in levels]
    return CsrTrie(level_sizes, indptrs, codes, child_ids, widths)


def build_trie(
    catalog_codes: np.ndarray,
    level_sizes: Sequence[int],
    *,
    kind: Literal["auto", "dense", "csr"] = "auto",
    dense_max_bytes: int = 64 << 20,
) -> Trie:
    """Build the trie of `catalog_codes` (int [num_sids, depth], unique; sorted as in
    Catalog.codes so that last-level child ids are catalog rows; unsorted input keeps its own
    row numbers). "auto" picks dense tables when they fit `dense_max_bytes`, else CSR."""
    if kind not in ("auto", "dense", "csr"):
        raise TrieError(f"trie kind {kind!r} is unknown; expected 'auto', 'dense' or 'csr'")
    assert len(catalog_codes) < 2**31, "child ids are stored as int32"
    levels = _trie_levels(catalog_codes, level_sizes)
    dense_bytes = sum(lv.num_nodes * k * 4 for lv, k in zip(levels, level_sizes, strict=True))
    chosen = kind if kind != "auto" else ("dense" if dense_bytes <= dense_max_bytes else "csr")
    if chosen == "dense" and dense_bytes > dense_max_bytes:
        raise TrieError(
            f"dense trie tables need {dense_bytes >> 20} MiB, over dense_max_bytes "
            f"{dense_max_bytes >> 20} MiB; use kind='csr' or 'auto', or raise dense_max_bytes"
        )
    trie = _dense_trie(levels, level_sizes) if chosen == "dense" else _csr_trie(levels, level_sizes)
    logger.info(
        "trie: %s, %d SIDs, nodes per level %s, widths %s, %.1f MiB",
        chosen,
        trie.num_sids,
        [trie.num_nodes(d) for d in range(trie.depth)],
        [trie.max_children(d) for d in range(trie.depth)],
        trie.nbytes / 2**20,
    )
    return trie
