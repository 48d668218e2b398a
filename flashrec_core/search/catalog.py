"""The item catalog: which semantic IDs exist and which item ids each one names."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np


class CatalogError(ValueError):
    """A catalog file is malformed or disagrees with the SID level sizes."""


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous; compare codes/items explicitly
class Catalog:
    """Unique SIDs sorted lexicographically, and the item ids each one names.

    Row `i` of `codes` is the SID whose items are `items[i]`; the trie's last level uses the
    same row index, so a finished beam maps to its items without a search.
    """

    codes: np.ndarray  # int64 [num_sids, depth]
    items: tuple[tuple[str, ...], ...]
    level_sizes: tuple[int, ...]

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
) -> Catalog:
    """Validate and sort entries `codes[i] -> items[i]`; entries sharing a SID are merged, or
    rejected when `merge` is False (formats whose keys must be unique). `label(i)` names entry
    i in error messages."""
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
    return Catalog(codes=unique, items=tuple(grouped), level_sizes=sizes)


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


_INT = re.compile(r"\s*[+-]?[0-9]+\s*")


def _parse_codes(
    flat: list[str], width: int, first: int, source: str, label: Callable[[int], str]
) -> np.ndarray:
    """Row-major fields, `width` per entry, codes in columns first.. -> int64 [n, depth]."""
    n, columns = len(flat) // width, []
    for col in range(first, width):
        cells = flat[col::width]
        try:  # C-speed parse; any doubt falls through to the cell-by-cell check below
            parsed = np.fromstring(",".join(cells), dtype=np.int64, sep=",")
        except ValueError:
            parsed = np.empty(0, dtype=np.int64)
        if len(parsed) != n:
            bad = next((i for i, cell in enumerate(cells) if not _INT.fullmatch(cell)), 0)
            raise CatalogError(
                f"catalog {source}: {label(bad)} has code {cells[bad]!r} at level "
                f"{col - first}, expected a non-negative integer"
            )
        columns.append(parsed)
    return np.stack(columns, axis=1)


def _json_items(pairs: list[tuple[str, Any]], source: Path) -> list[tuple[str, ...]]:
    """Item ids per key: a string, an integer, or a non-empty list of them."""
    if set(map(type, (v for _, v in pairs))) <= {str, int}:  # the common case, at C speed
        return [(v,) if type(v) is str else (str(v),) for _, v in pairs]
    return [_item_ids(value, source, key) for key, value in pairs]


def _item_ids(value: Any, source: Path, key: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    ids = tuple(str(v) for v in values)
    if not values or not all(type(v) in (str, int) for v in values) or len(set(ids)) < len(ids):
        raise CatalogError(
            f"catalog {source}: key {key!r} has value {value!r}; expected an item id (string or "
            f"integer) or a non-empty list of distinct ones"
        )
    return ids


class _Pairs(list):
    """A JSON object kept as its (key, value) pairs, so duplicate keys survive to be reported."""


def _read_json_pairs(path: Path) -> list[tuple[str, Any]]:
    """Top-level (key, value) pairs in file order (build_catalog rejects repeated keys)."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            top = json.load(f, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        raise CatalogError(f"catalog {path} is not valid JSON: {e}") from None
    if not isinstance(top, _Pairs) or not top:
        raise CatalogError(
            f'catalog {path} must be a non-empty JSON object {{"c1,c2,c3": item id, ...}}, '
            f"found {json.dumps(top)[:40]}"
        )
    return top


def _load_json(path: Path, level_sizes: Sequence[int]) -> Catalog:
    pairs = _read_json_pairs(path)
    keys = [key for key, _ in pairs]
    depths = np.fromiter(map(str.count, keys, repeat(",")), dtype=np.int64, count=len(keys)) + 1
    if len(level_sizes) > 1 and depths.max() == 1:
        raise CatalogError(
            f"catalog {path} has packed integer keys (e.g. {keys[0]!r}) but {len(level_sizes)} "
            f"SID levels; convert it once with `flashrec catalog convert {path} OUT.json "
            f"--level-sizes {','.join(map(str, level_sizes))}` and load OUT.json"
        )
    if (depths != depths[0]).any():
        i = int(np.argmax(depths != depths[0]))
        raise CatalogError(
            f"catalog {path}: key {keys[i]!r} has {depths[i]} codes but key {keys[0]!r} has "
            f"{depths[0]}; every SID must have the same depth"
        )

    def label(i: int) -> str:
        return f"key {keys[i]!r}"

    codes = _parse_codes(",".join(keys).split(","), int(depths[0]), 0, str(path), label)
    items = _json_items(pairs, path)
    return build_catalog(codes, items, level_sizes, source=str(path), label=label, merge=False)


def _csv_fields(text: str, delimiter: str) -> tuple[Sequence[int], list[str], np.ndarray]:
    """(line number, field count) of each non-blank line, and all fields row-major."""
    if '"' in text:  # quoted fields: only the csv module parses those right
        rows = [
            (n, r)
            for n, r in enumerate(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter), 1)
        ]
        rows = [(n, r) for n, r in rows if r]
        counts = np.array([len(r) for _, r in rows], dtype=np.int64)
        return [n for n, _ in rows], [f for _, r in rows for f in r], counts
    lines = text.splitlines()
    numbers: Sequence[int] = range(1, len(lines) + 1)
    if "" in lines:
        numbers = [n for n, line in enumerate(lines, 1) if line]
        lines = [line for line in lines if line]
    counts = np.fromiter(map(str.count, lines, repeat(delimiter)), np.int64, len(lines)) + 1
    return numbers, delimiter.join(lines).split(delimiter), counts


def _load_csv(path: Path, level_sizes: Sequence[int], delimiter: str) -> Catalog:
    lines, flat, counts = _csv_fields(path.read_text(encoding="utf-8-sig"), delimiter)
    if len(counts) and not any(_INT.fullmatch(c) for c in flat[1 : counts[0]]):
        # no integer code on the first line: a header such as item_id,c1,c2,c3
        lines, flat, counts = lines[1:], flat[counts[0] :], counts[1:]
    if not len(counts):
        raise CatalogError(f"catalog {path} is empty; expected rows item_id,c1,c2,...")
    width = int(counts[0])
    if (counts != width).any() or width < 2:
        i = int(np.argmax(counts != width))
        start = int(counts[:i].sum())
        raise CatalogError(
            f"catalog {path}: line {lines[i]} has {counts[i]} fields "
            f"{flat[start : start + counts[i]]}, expected {max(width, 2)} (item_id then one "
            f"code per level, as on line {lines[0]})"
        )

    def label(i: int) -> str:
        return f"line {lines[i]}"

    codes = _parse_codes(flat, width, 1, str(path), label)
    items = [(item,) for item in flat[0::width]]
    return build_catalog(codes, items, level_sizes, source=str(path), label=label)


def _existing(path: str | Path) -> Path:
    if not Path(path).is_file():
        raise CatalogError(f"catalog file {path} does not exist; pass the path of a catalog file")
    return Path(path)


def load_catalog(path: str | Path, level_sizes: Sequence[int]) -> Catalog:
    """Load a catalog: JSON {"c1,c2,c3": item id or [ids]}, or CSV/TSV rows item_id,c1,c2,c3."""
    path = _existing(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _load_json(path, level_sizes)
    if suffix in (".csv", ".tsv"):
        return _load_csv(path, level_sizes, "," if suffix == ".csv" else "\t")
    raise CatalogError(f"catalog {path} has extension {path.suffix!r}; expected .json/.csv/.tsv")


def convert_packed_catalog(src: str | Path, dst: str | Path, level_sizes: Sequence[int]) -> Catalog:
    """Rewrite a RecIF packed-integer JSON catalog (key a*K1*K2 + b*K2 + c, mixed radix with the
    last level fastest) with "a,b,c" keys. Validates everything before writing `dst`."""
    src, dst = _existing(src), Path(dst)
    if math.prod(level_sizes) >= 1 << 63:
        raise CatalogError(
            f"packed SIDs with level sizes {tuple(level_sizes)} do not fit 64 bits; such a "
            f'catalog cannot be packed, write it with "c1,c2,..." keys instead'
        )
    pairs = _read_json_pairs(src)
    keys = [key for key, _ in pairs]

    def label(i: int) -> str:
        return f"packed key {keys[i]!r}"

    rest = _parse_codes(keys, 1, 0, str(src), label)[:, 0]
    codes = np.empty((len(keys), len(level_sizes)), dtype=np.int64)
    for lvl in range(len(level_sizes) - 1, 0, -1):
        rest, codes[:, lvl] = np.divmod(rest, level_sizes[lvl])
    codes[:, 0] = rest
    items = _json_items(pairs, src)
    catalog = build_catalog(codes, items, level_sizes, source=str(src), label=label, merge=False)
    columns = (map(str, codes[:, lvl].tolist()) for lvl in range(codes.shape[1]))
    new_keys = map(",".join, zip(*columns, strict=True))
    dst.write_text(json.dumps(dict(zip(new_keys, (v for _, v in pairs), strict=True))), "utf-8")
    return catalog
