"""Catalog file formats: JSON ("c1,c2,c3" keys, bare or under "sids" next to item metadata under
"items"), CSV/TSV rows, and RecIF packed-integer keys (converted, never loaded directly). Every
reader ends in `build_catalog`, the one validator."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from flashrec_core.search.catalog import Catalog, CatalogError, build_catalog

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


class _Repeated(dict):
    """A JSON object with a repeated key: a dict as `json` would build it (the last value wins),
    keeping its (key, value) pairs so that a SID object's repeats can be reported."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a plain dict unless a key repeats. Plain dicts need no second pass
    (a hook that kept every object as pairs cost a million-item catalog's metadata 2 s more)."""
    made = dict(pairs)
    return made if len(made) == len(pairs) else _Repeated(pairs)


def _pairs_of(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    return obj.pairs if isinstance(obj, _Repeated) else list(obj.items())


_KEY_END = re.compile(r'"[ \t\n\r]*:')


def _parse_json(text: str) -> Any:
    """`json.loads` with repeated keys kept (`_object`), at orjson's speed where that is exact.

    orjson parses a million-item catalog in a third of the time, but keeps the last value of a
    repeated key without a word. So its result stands only when it holds as many keys as the
    text writes. Every key is a string followed by a colon, so counting quotes followed by a
    colon counts every key, plus any such pair inside a string (an escaped quote): the count
    can only exceed the parsed keys, by a repeat or by such a pair. Equal counts mean neither.
    Otherwise, or for a text orjson refuses (NaN, huge integers), the standard library parses
    it and reports exactly as before."""
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    else:
        if _count_keys(parsed) == len(_KEY_END.findall(text)):
            return parsed
    return json.loads(text, object_pairs_hook=_object)


def _count_keys(value: Any) -> int:
    """Keys of every object in a parsed JSON value."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            count += len(v)
            stack.extend(x for x in v.values() if type(x) is dict or type(x) is list)
        elif type(v) is list:
            stack.extend(x for x in v if type(x) is dict or type(x) is list)
    return count


def _read_json_pairs(path: Path) -> list[tuple[str, Any]]:
    """Top-level (key, value) pairs in file order (build_catalog rejects repeated keys)."""
    try:
        top = _parse_json(read_utf8(path, "catalog"))
    except json.JSONDecodeError as e:
        raise CatalogError(f"catalog {path} is not valid JSON: {e}") from None
    if not isinstance(top, dict) or not top:
        raise CatalogError(
            f'catalog {path} must be a non-empty JSON object {{"c1,c2,c3": item id, ...}}, '
            f"found {json.dumps(top)[:40]}"
        )
    return _pairs_of(top)


def _split_metadata(
    pairs: list[tuple[str, Any]], path: Path
) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """{"sids": {...}, "items": {...}} -> (SID pairs, item metadata); a bare SID object passes
    through ("sids" can never be a SID key: keys are comma-separated integers)."""
    top = dict(pairs)
    if "sids" not in top:
        return pairs, {}
    extra = sorted(set(top) - {"sids", "items"})
    sids, items = top["sids"], top.get("items", {})
    if extra or not isinstance(sids, dict) or not sids or not isinstance(items, dict):
        raise CatalogError(
            f'catalog {path} has a "sids" key, so it must be {{"sids": {{"c1,c2,c3": item id, '
            f'...}}, "items": {{item id: {{attribute: value}}}}}} with a non-empty "sids" object'
            + (f"; unexpected keys {extra}" if extra else "")
        )
    return _pairs_of(sids), items


def _load_json(path: Path, level_sizes: Sequence[int]) -> Catalog:
    pairs, metadata = _split_metadata(_read_json_pairs(path), path)
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
    return build_catalog(
        codes, items, level_sizes, source=str(path), label=label, merge=False, metadata=metadata
    )


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


def read_utf8(path: Path, what: str) -> str:
    """A text file's contents (a UTF-8 BOM is dropped); invalid UTF-8 is an error naming the
    file and the byte offset."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise CatalogError(
            f"{what} {path} is not valid UTF-8 (byte {e.start}: {e.object[e.start : e.start + 1]!r}"
            f"); re-save it as UTF-8"
        ) from None


def _load_csv(path: Path, level_sizes: Sequence[int], delimiter: str) -> Catalog:
    lines, flat, counts = _csv_fields(read_utf8(path, "catalog"), delimiter)
    if len(counts) and counts[0] == 1:
        name = "tab" if delimiter == "\t" else repr(delimiter)
        raise CatalogError(
            f"catalog {path}: line {lines[0]} has 1 field {flat[0][:40]!r}; expected item_id and "
            f"one code per level separated by {name} (a {path.suffix} file); convert the separator"
        )
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
