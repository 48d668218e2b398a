"""Per-request item filters applied inside the constrained search.

A filter decides which catalog SIDs a request may return: a SID stays allowed while at least one
of its items is (a SID shared by several items stays open while any of them is allowed, and the
answer lists only the allowed ones). Inside the search, a trie prefix stays open only while its
subtree still holds an allowed SID, so n allowed items come back whenever the filtered catalog
holds n, and an excluded item never takes a beam slot.

On the device a wave of filtered requests carries one mask per trie level, `allowed[level]`
bool [B, nodes at level + 1] (the last level's "nodes" are catalog rows), built from the
requests' SID masks by OR-ing them up the trie. At selection, a row's children that its request
does not allow get log-prob -inf before top-k, exactly as the trie's own invalid children do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashrec_core.search.catalog import Catalog
from flashrec_core.search.trie import Trie


class FilterError(ValueError):
    """A filter that names nothing in the catalog, or is malformed; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, eq=False)
class ItemFilter:
    """Which SIDs (catalog rows) and items one request may return."""

    sid_mask: np.ndarray  # bool [num_sids]: at least one of the SID's items is allowed
    excluded: frozenset[str]
    allowed: frozenset[str] | None  # None: every item not excluded

    def keeps(self, item: str) -> bool:
        return item not in self.excluded and (self.allowed is None or item in self.allowed)

    @property
    def num_sids(self) -> int:
        return int(self.sid_mask.sum())


class CatalogIndex:
    """Item id -> catalog rows, and each row's trie ancestors: built once per catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        rows: dict[str, list[int]] = {}
        for row, items in enumerate(catalog.items):
            for item in items:
                rows.setdefault(item, []).append(row)
        self.rows_of = rows
        self.items_per_row = np.array([len(t) for t in catalog.items], dtype=np.int64)
        self.ancestors = prefix_nodes(catalog.codes)

    def create_filter(
        self, exclude_items: Sequence[str] = (), allow_items: Sequence[str] | None = None
    ) -> ItemFilter | None:
        """The filter of one request, or None when it filters nothing."""
        if not exclude_items and allow_items is None:
            return None
        num = len(self.catalog)
        excluded = frozenset(exclude_items)
        if allow_items is None:  # a SID stays while any of its items is not excluded
            hits = np.bincount(self._rows(excluded), minlength=num)
            return ItemFilter(hits < self.items_per_row, excluded, None)
        allowed = frozenset(allow_items)
        mask = np.zeros(num, dtype=bool)  # a SID stays while any allowed item is not excluded
        mask[self._rows(allowed - excluded)] = True
        if not mask.any():
            raise FilterError(
                "no item of allow_items (less exclude_items) is in the catalog", "allow_items"
            )
        return ItemFilter(mask, excluded, allowed)

    def _rows(self, items: Iterable[str]) -> np.ndarray:
        rows = [r for item in items for r in self.rows_of.get(item, ())]
        return np.asarray(rows, dtype=np.int64)


def prefix_nodes(codes: np.ndarray) -> list[np.ndarray]:
    """For sorted, unique SIDs [N, depth]: out[d][i] = trie node id of row i's prefix of length
    d + 1, at level d + 1 (numbered as `build_trie` numbers them); the last entry is the row."""
    n, depth = codes.shape
    differs = np.ones((n, depth), dtype=bool)
    differs[1:] = codes[1:] != codes[:-1]
    opens = np.zeros(n, dtype=bool)
    opens[0] = True
    out = []
    for d in range(depth - 1):
        opens |= differs[:, d]
        out.append(np.cumsum(opens) - 1)
    out.append(np.arange(n, dtype=np.int64))
    return out


class FilterMasks:
    """One wave's per-level allowed-children masks, on the device (see the module docstring)."""

    def __init__(self, levels: list[torch.Tensor]) -> None:
        self.levels = levels  # [level] bool [B, num_nodes(level + 1)]

    @classmethod
    def create(
        cls,
        filters: Sequence[ItemFilter | None],
        index: CatalogIndex,
        trie: Trie,
        device: torch.device,
    ) -> FilterMasks | None:
        if all(f is None for f in filters):
            return None
        num = len(index.catalog)
        sid = np.ones((len(filters), num), dtype=bool)  # unfiltered requests allow everything
        for b, f in enumerate(filters):
            if f is not None:
                sid[b] = f.sid_mask
        leaves = torch.from_numpy(sid).to(device)
        levels = []
        for d in range(trie.depth - 1):  # children of level d are nodes at level d + 1
            parent = torch.from_numpy(index.ancestors[d]).to(device)
            mask = torch.zeros(
                len(filters), trie.num_nodes(d + 1), dtype=torch.uint8, device=device
            )
            src = leaves.to(torch.uint8)
            mask.scatter_reduce_(1, parent.expand(len(filters), -1), src, reduce="amax")
            levels.append(mask.bool())
        levels.append(leaves)
        return cls(levels)

    def select(self, keep: torch.Tensor) -> FilterMasks:
        """The masks of the requests `keep` (indices) only, in that order."""
        return FilterMasks([m[keep] for m in self.levels])

    def apply(
        self, trie: Trie, level: int, nodes: torch.Tensor, row_request: torch.Tensor,
        log_probs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """log_probs [R, K] with every child its row's request does not allow set to -inf."""
        children = trie.children(level, nodes)  # [R, W] codes, child ids, valid
        allowed = self.levels[level][row_request[:, None], children.child]
        blocked = children.valid & ~allowed
        size = log_probs.shape[1]
        target = torch.where(blocked, children.codes, size)  # column `size` absorbs the rest
        out = torch.cat([log_probs, log_probs.new_zeros(log_probs.shape[0], 1)], dim=1)
        out.scatter_(1, target, float("-inf"))
        return out[:, :size]
