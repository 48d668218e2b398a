"""The item catalog: which semantic IDs exist and which item ids each one names."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class CatalogError(ValueError):
    """A catalog file is malformed or disagrees with the SID level sizes."""


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous; compare codes/items explicitly
class Catalog:
    """Unique SIDs sorted lexicographically, and the item ids each one names.

    Row `i` of `codes` is the SID whose items are `items[i]`; the trie's last level uses the
    same row index, so a finished beam maps to its items without a search. `metadata` maps an
    item id to its attributes ({"title": ..., "category": ...}); items without any are absent.
    """

    codes: np.ndarray  # int64 [num_sids, depth]
    items: tuple[tuple[str, ...], ...]
    level_sizes: tuple[int, ...]
    metadata: Mapping[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        return int(self.codes.shape[1])

    @property
    def num_items(self) -> int:
        return sum(len(group) for group in self.items)

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def row_of(self, codes: Sequence[int]) -> int:
        """Row index of a SID, or -1 when the catalog lacks it (binary search per level)."""
        if len(codes) != self.depth:
            return -1
        lo, hi = 0, len(self)
        for lvl, code in enumerate(codes):
            col = self.codes[lo:hi, lvl]  # sorted: rows lo..hi share the prefix so far
            lo, hi = lo + col.searchsorted(code, "left"), lo + col.searchsorted(code, "right")
        return int(lo) if lo < hi else -1

    def label(self, item: str) -> str:
        """An item id with its title and category when the metadata has them."""
        attrs = self.metadata.get(item, {})
        named = [str(attrs[k]) for k in ("title", "category") if attrs.get(k) not in (None, "")]
        return f"{item} ({'; '.join(named)})" if named else item

    def lookup(self, codes: Sequence[int]) -> tuple[str, ...]:
        """Item ids of one SID; KeyError when the catalog has no such SID."""
        row = self.row_of(codes)
        if row < 0:
            raise KeyError(f"SID {tuple(int(c) for c in codes)} is not in the catalog")
        return self.items[row]


def build_catalog(
    codes: np.ndarray,
    items: Sequence[tuple[str, ...]],
    level_sizes: Sequence[int],
    *,
    source: str = "<memory>",
    label: Callable[[int], str] = lambda i: f"entry {i}",
    merge: bool = True,
    metadata: Mapping[str, dict[str, Any]] | None = None,
) -> Catalog:
    """Validate and sort entries `codes[i] -> items[i]`; entries sharing a SID are merged, or
    rejected when `merge` is False (formats whose keys must be unique). `label(i)` names entry
    i in error messages. `metadata` (item id -> attributes) may only name catalog items."""
    codes = np.asarray(codes, dtype=np.int64)
    _check_codes(codes, level_sizes, source, label)
    order = _lex_order(codes, level_sizes)
    ordered = codes[order]
    same = np.all(ordered[1:] == ordered[:-1], axis=1)  # [n-1] row j+1 repeats row j
    if same.any() and not merge:
        j = int(np.argmax(same))
        first, second = label(int(order[j])), label(int(order[j + 1]))
        what = f"{first} appears twice" if first == second else f"{first} and {second} name"
        raise CatalogError(
            f"catalog {source}: {what} SID {tuple(ordered[j].tolist())}; keys must be unique: "
            f"list all items of a SID under one key"
        )
    unique = np.ascontiguousarray(ordered[np.concatenate([[True], ~same])])
    grouped = [items[i] for i in order.tolist()]
    if same.any():
        grouped = _merge_runs(grouped, same, unique, source)
    sizes = tuple(int(k) for k in level_sizes[: codes.shape[1]])
    meta = _check_metadata(metadata or {}, grouped, source)
    return Catalog(codes=unique, items=tuple(grouped), level_sizes=sizes, metadata=meta)


def _check_metadata(
    metadata: Mapping[str, Any], grouped: Sequence[tuple[str, ...]], source: str
) -> dict[str, dict[str, Any]]:
    """Item attributes must be objects and name items some SID lists (a typo is an error)."""
    if not metadata:
        return {}
    known = {item for group in grouped for item in group}
    for item, attrs in metadata.items():
        if not isinstance(attrs, dict):
            raise CatalogError(
                f'catalog {source}: "items" entry {item!r} is {_short_repr(attrs)}; expected an '
                f'object of attributes such as {{"title": "...", "category": "..."}}'
            )
        if item not in known:
            raise CatalogError(
                f'catalog {source}: "items" has metadata for {item!r}, which no SID lists; '
                f"add the item under a SID or drop its metadata"
            )
    return {str(item): dict(attrs) for item, attrs in metadata.items()}


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_codes(
    codes: np.ndarray, level_sizes: Sequence[int], source: str, label: Callable[[int], str]
) -> None:
    if codes.ndim != 2 or codes.shape[0] == 0:
        raise CatalogError(f"catalog {source} is empty; expected at least one SID -> item entry")
    if codes.shape[1] > len(level_sizes):
        raise CatalogError(
            f"catalog {source} has SIDs of depth {codes.shape[1]} ({label(0)}) but the SID level "
            f"sizes {tuple(level_sizes)} cover only {len(level_sizes)} levels; pass one "
            f"--sid-level-sizes entry per catalog level"
        )
    for lvl in range(codes.shape[1]):
        bad = (codes[:, lvl] < 0) | (codes[:, lvl] >= level_sizes[lvl])
        if bad.any():
            i = int(np.argmax(bad))
            raise CatalogError(
                f"catalog {source}: {label(i)} has code {codes[i, lvl]} at level {lvl}, "
                f"expected 0..{level_sizes[lvl] - 1}; fix the entry or the --sid-level-sizes"
            )


def _lex_order(codes: np.ndarray, level_sizes: Sequence[int]) -> np.ndarray:
    """Stable lexicographic row order; one packed-key argsort when the SID fits 62 bits."""
    if math.prod(level_sizes[: codes.shape[1]]) >= 1 << 62:
        return np.lexsort(codes.T[::-1])
    key = codes[:, 0].copy()
    for lvl in range(1, codes.shape[1]):
        key = key * level_sizes[lvl] + codes[:, lvl]
    return np.argsort(key, kind="stable")


def _merge_runs(
    grouped: list[tuple[str, ...]], same: np.ndarray, unique: np.ndarray, source: str
) -> list[tuple[str, ...]]:
    """Concatenate the item tuples of each run of equal SIDs (in file order)."""
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    bounds = np.append(starts, len(grouped))
    merged = [grouped[s] for s in starts.tolist()]
    for g in np.flatnonzero(np.diff(bounds) > 1).tolist():
        group = tuple(item for t in grouped[bounds[g] : bounds[g + 1]] for item in t)
        if len(set(group)) != len(group):
            raise CatalogError(
                f"catalog {source}: SID {tuple(unique[g].tolist())} lists an item id twice "
                f"{group}; remove the duplicate"
            )
        merged[g] = group
    return merged
