"""A trie that allows every code at every level: decoding without a catalog.

Used by `flashrec generate` without `--catalog` as a connectivity check: beams are any code
sequence of the codebook levels. Node ids are all 0 and no item ids come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashrec_core.search.trie import Trie, TrieChildren
from flashrec_kernels import DenseLevel


class UnconstrainedTrie(Trie):
    def __init__(self, level_sizes: Sequence[int], device: torch.device | str = "cpu") -> None:
        super().__init__(level_sizes, [1] * (len(level_sizes) + 1), level_sizes)
        self.device = torch.device(device)
        self._codes = [torch.arange(k, device=self.device)[None, :] for k in self.level_sizes]
        # every code present, child node 0 (the only node of each level)
        self._tables = [
            torch.zeros((1, k), dtype=torch.int32, device=self.device) for k in self.level_sizes
        ]

    @property
    def nbytes(self) -> int:
        return 0

    def children(self, level: int, nodes: torch.Tensor) -> TrieChildren:
        codes = self._codes[level].expand(nodes.shape[0], -1)
        zeros = torch.zeros_like(codes)
        return TrieChildren(codes, zeros, torch.ones_like(codes, dtype=torch.bool))

    def kernel_level(self, level: int) -> DenseLevel:
        return DenseLevel(self._tables[level])

    def to(self, device: torch.device | str) -> UnconstrainedTrie:
        return UnconstrainedTrie(self.level_sizes, device)
