"""Per-request item filters applied inside the constrained search.

A filter decides which catalog SIDs a request may return: a SID stays allowed while at least one
of its items is (a SID shared by several items stays open while any of them is allowed, and the
answer lists only the allowed ones). Inside the search, a trie prefix stays open only while its
subtree still holds an allowed SID, so n allowed items come back whenever the filtered catalog
holds n, and an excluded item never takes a beam slot.

On the device a wave of filtered requests carries one mask per trie level, `allowed[level]`
bool [B, nodes at level + 1] (the last level's "nodes" are catalog rows), built from the
requests' SID masks by OR-ing them up the trie. SIDs are sorted, so each trie node's rows are
one contiguous run: a node is allowed when the running count of allowed rows grows across its
run (a cumulative sum and a gather, no atomics: an atomic max over a million rows into 8,192
first-level nodes serializes on the hot words). At selection, a row's children that its request
does not allow get log-prob -inf before top-k, exactly as the trie's own invalid children do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from flashrec_core.search.catalog import Catalog
from flashrec_core.search.trie import Trie


class FilterError(ValueError):
    """A filter that names nothing in the catalog, or is malformed; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


AttrValue = str | int | float | bool
AttrFilters = Mapping[str, AttrValue | Sequence[AttrValue]]


@dataclass(frozen=True, eq=False)
class ItemFilter:
    """Which SIDs (catalog rows) and items one request may return.

    The search reads the SIDs alone, as bits; the items are for shaping answers. The engine
    process (server/engine_process.py) receives the bits alone and rebuilds a search-only
    filter (`for_search`, no `item_mask`): unpacking both masks and re-packing the SIDs there
    cost 0.2 ms a filtered request at a million rows (CPU machine) on the thread that feeds the
    engine loop, and the item bits 125 KB more through the pipe."""

    packed_sids: np.ndarray = field(repr=False)
    """uint8, np.packbits of bool [catalog rows]: 1 where at least one of the SID's items is
    allowed. What a GPU wave uploads, 8x less than the bools; packed when the request is made,
    off the engine thread."""
    index: CatalogIndex
    item_mask: np.ndarray | None = None
    """bool [distinct items]: the item may be returned; None in a search-only filter."""

    @classmethod
    def create(cls, sid_mask: np.ndarray, item_mask: np.ndarray, index: CatalogIndex) -> ItemFilter:
        made = cls(np.packbits(sid_mask), index, item_mask)
        object.__setattr__(made, "sid_mask", sid_mask)  # cached_property's slot: no unpacking
        return made

    @classmethod
    def for_search(cls, packed_sids: np.ndarray, index: CatalogIndex) -> ItemFilter:
        """The SID bits alone (a request's filter as the engine process receives it)."""
        return cls(packed_sids, index)

    @cached_property
    def sid_mask(self) -> np.ndarray:
        """bool [catalog rows]: `packed_sids` unpacked (what a CPU wave reads)."""
        return np.unpackbits(self.packed_sids, count=len(self.index.catalog)).astype(bool)

    @cached_property
    def num_closed(self) -> int:
        """Catalog SIDs this filter closes (none of their items allowed): the candidates the
        search never opens for this request (the server's flashrec_filtered_sids_total)."""
        return int(self.sid_mask.size - np.count_nonzero(self.sid_mask))

    def keeps(self, item: str) -> bool:
        i = self.index.item_index.get(item)
        return i is not None and bool(self._items[i])

    @property
    def excluded(self) -> frozenset[str]:
        """The catalog items this filter removes (tests, diagnostics)."""
        ids = self.index.item_ids
        return frozenset(ids[i] for i in np.flatnonzero(~self._items).tolist())

    @property
    def num_sids(self) -> int:
        return self.sid_mask.size - self.num_closed

    @property
    def _items(self) -> np.ndarray:
        if self.item_mask is None:
            raise TypeError("a search-only ItemFilter (for_search) has no item mask")
        return self.item_mask


class CatalogIndex:
    """Built once per catalog: every (item, SID row) occurrence as arrays, each row's trie
    ancestors, and (lazily, per attribute) which items hold each attribute value."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.item_ids: list[str] = []
        self.item_index: dict[str, int] = {}
        occ_item, occ_row = [], []
        for row, items in enumerate(catalog.items):
            for item in items:
                i = self.item_index.setdefault(item, len(self.item_ids))
                if i == len(self.item_ids):
                    self.item_ids.append(item)
                occ_item.append(i)
                occ_row.append(row)
        self.occ_item = np.asarray(occ_item, dtype=np.int64)  # [occurrences]
        self.occ_row = np.asarray(occ_row, dtype=np.int64)
        self.ancestors = prefix_nodes(catalog.codes)
        self.node_ends = [last_rows(a) for a in self.ancestors[:-1]]
        self._values: dict[str, dict[AttrValue, list[int]]] = {}
        self._device_ends: dict[torch.device, list[torch.Tensor]] = {}

    def node_ends_on(self, device: torch.device) -> list[torch.Tensor]:
        """`node_ends` (the last catalog row of each inner-level trie node) on `device`,
        uploaded once per catalog (call it on the engine thread)."""
        if device not in self._device_ends:
            self._device_ends[device] = [torch.from_numpy(e).to(device) for e in self.node_ends]
        return self._device_ends[device]

    def create_filter(
        self,
        exclude_items: Sequence[str] = (),
        allow_items: Sequence[str] | None = None,
        filters: AttrFilters | None = None,
    ) -> ItemFilter | None:
        """The filter of one request, or None when it filters nothing. An item may be returned
        when it is not excluded, is in `allow_items` (if given) and matches every attribute of
        `filters` (a list of values: any of them); a SID stays while any of its items may."""
        if not exclude_items and allow_items is None and not filters:
            return None
        keep = np.ones(len(self.item_ids), dtype=bool)
        if allow_items is not None:
            keep &= self._mask(allow_items)
        for key, wanted in (filters or {}).items():
            keep &= self._attribute_mask(key, wanted)
        keep &= ~self._mask(exclude_items)
        sid_mask = np.zeros(len(self.catalog), dtype=bool)
        sid_mask[self.occ_row[keep[self.occ_item]]] = True
        if not sid_mask.any():
            given = {"allow_items": allow_items is not None, "filters": bool(filters),
                     "exclude_items": bool(exclude_items)}  # fmt: skip
            fields = [f for f, on in given.items() if on]
            raise FilterError(
                f"no catalog item is left after {' and '.join(fields)}; widen them", fields[0]
            )
        return ItemFilter.create(sid_mask, keep, self)

    def allow_all(self) -> ItemFilter:
        """A filter that keeps every item: a filtered wave's shapes without changing results
        (warm-up captures the filtered CUDA graphs with it)."""
        return ItemFilter.create(
            np.ones(len(self.catalog), dtype=bool), np.ones(len(self.item_ids), dtype=bool), self
        )

    def _mask(self, items: Iterable[str]) -> np.ndarray:
        mask = np.zeros(len(self.item_ids), dtype=bool)
        idx = [self.item_index[i] for i in items if i in self.item_index]
        mask[idx] = True
        return mask

    def _attribute_mask(self, key: str, wanted: AttrValue | Sequence[AttrValue]) -> np.ndarray:
        values = self._values_of(key)
        choices = list(wanted) if isinstance(wanted, (list, tuple)) else [wanted]
        if not choices:
            raise FilterError(f"filters.{key} is an empty list; give at least one value", "filters")
        mask = np.zeros(len(self.item_ids), dtype=bool)
        for value in choices:
            mask[values.get(_key(value), [])] = True
        return mask

    def _values_of(self, key: str) -> dict[AttrValue, list[int]]:
        if key not in self._values:
            meta = self.catalog.metadata
            known = sorted({k for attrs in meta.values() for k in attrs})
            if key not in known:
                raise FilterError(
                    f"filters names attribute {key!r}, which no catalog item has; the catalog's "
                    f"item attributes are: {', '.join(known) or 'none (the catalog has no item metadata)'}",
                    "filters",
                )  # fmt: skip
            index: dict[AttrValue, list[int]] = {}
            for item, attrs in meta.items():
                if key in attrs and item in self.item_index:
                    index.setdefault(_key(attrs[key]), []).append(self.item_index[item])
            self._values[key] = index
        return self._values[key]


def _key(value: object) -> AttrValue:
    """A hashable attribute value: bools stay bools (True != 1 here), lists become tuples."""
    if isinstance(value, bool):
        return ("bool", value)  # type: ignore[return-value]
    if isinstance(value, list):
        return tuple(_key(v) for v in value)  # type: ignore[return-value]
    return value  # type: ignore[return-value]


def unpack_bits(bits: torch.Tensor, num: int) -> torch.Tensor:
    """uint8 [B, ceil(num / 8)] of np.packbits rows (first element in the top bit) -> uint8
    [B, num] of 0 / 1, on the tensor's device."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :num]


def last_rows(nodes: np.ndarray) -> np.ndarray:
    """For `prefix_nodes`' nondecreasing node ids of one level (0, 0, 1, 1, 1, 2, ...): the last
    row of each node, int64 [num_nodes]."""
    return np.flatnonzero(np.append(nodes[1:] != nodes[:-1], True)).astype(np.int64)


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


MASK_GROUP_REQUESTS = 16
"""Requests whose masks `FilterMasks.create` builds at once (its temporaries scale with it)."""


def _allowed_rows(
    filters: Sequence[ItemFilter | None], num: int, device: torch.device
) -> torch.Tensor:
    """uint8 [len(filters), num]: 1 where a request may return the catalog row (every row for a
    request without a filter), on `device`."""
    if device.type == "cpu":  # nothing to upload: the bools as they are
        everything = np.ones(num, dtype=bool)  # an unfiltered request
        sids = np.stack([f.sid_mask if f is not None else everything for f in filters])
        return torch.from_numpy(sids.view(np.uint8))
    # upload the requests' bits (1 MB of bools is 125 KB), unpacked on the device
    everything = np.full((num + 7) // 8, 0xFF, dtype=np.uint8)
    packed = np.stack([f.packed_sids if f is not None else everything for f in filters])
    bits = torch.from_numpy(packed).to(device, non_blocking=True)
    return unpack_bits(bits, num)


class FilterMasks:
    """One wave's per-level allowed-children masks, on the device (see the module docstring)."""

    def __init__(self, levels: list[torch.Tensor]) -> None:
        self.levels = levels  # [level] bool [B, num_nodes(level + 1)]

    @classmethod
    def one_level(cls, level: int, depth: int, mask: torch.Tensor) -> FilterMasks:
        """Masks that hold only `level`'s (a CUDA graph's input for one beam step); the other
        levels are empty and must not be applied."""
        empty = mask.new_zeros(0, 0)
        return cls([mask if d == level else empty for d in range(depth)])

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
        ends_per_level = index.node_ends_on(device)  # level d's children: d + 1
        for d, ends in enumerate(ends_per_level):
            assert ends.numel() == trie.num_nodes(d + 1), (d, ends.numel(), trie.num_nodes(d + 1))
        sizes = [ends.numel() for ends in ends_per_level] + [num]
        levels = [
            torch.empty(len(filters), size, dtype=torch.bool, device=device) for size in sizes
        ]
        # The temporaries take ~18 bytes a catalog row a request (the running counts in int32,
        # each level's two gathers of them): 3 GB for a 163-request wave over a 1M-item catalog,
        # which ran an 80 GiB H100 out of memory beside the KV pool. In groups of requests they
        # stay at MASK_GROUP_REQUESTS of that.
        for start in range(0, len(filters), MASK_GROUP_REQUESTS):
            group = filters[start : start + MASK_GROUP_REQUESTS]
            rows = slice(start, start + len(group))
            leaves_u8 = _allowed_rows(group, num, device)
            # allowed rows up to and including each row; a node's count is its run's last entry
            running = leaves_u8.cumsum(1, dtype=torch.int32)
            for d, ends in enumerate(ends_per_level):
                upto = running[:, ends]  # [G, nodes]: allowed rows up to each node's last row
                before = torch.nn.functional.pad(upto[:, :-1], (1, 0))  # up to the node before
                torch.gt(upto, before, out=levels[d][rows])
            levels[-1][rows] = leaves_u8.view(torch.bool)  # 0/1 bytes
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
