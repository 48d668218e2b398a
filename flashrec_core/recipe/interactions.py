"""Interaction logs: CSV/TSV with named columns, or MovieLens-style headerless rows, plus an
optional item metadata file. Everything becomes one `InteractionLog` of chronological sequences."""

from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("flashrec")

MOVIELENS_COLUMNS = ("user_id", "item_id", "rating", "timestamp")


class InteractionsError(ValueError):
    """An interaction log or item metadata file is malformed."""


class LogFormat(BaseModel):
    """How to read an interaction log (CLI flags, recorded in recipe.json for `flashrec eval`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["file"] = "file"
    path: str
    format: Literal["auto", "csv", "tsv", "movielens"] = "auto"
    user_col: str = "user_id"
    item_col: str = "item_id"
    time_col: str = "timestamp"
    rating_col: str | None = None
    """Column compared against min_rating (MovieLens files: the third field)."""
    min_rating: float | None = None
    items_path: str | None = None
    """CSV/TSV with a header: the item id column (item_col, else the first) and attributes."""


@dataclass(frozen=True)
class InteractionLog:
    """Each user's items in time order (ties keep file order) and the items' attributes."""

    sequences: dict[str, list[str]]
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def items(self) -> list[str]:
        """Every item of the log, in first-appearance order over users in order."""
        return list(dict.fromkeys(i for seq in self.sequences.values() for i in seq))

    @property
    def num_interactions(self) -> int:
        return sum(len(s) for s in self.sequences.values())


def load_log(fmt: LogFormat) -> InteractionLog:
    """Read `fmt.path` (and `fmt.items_path`) into chronological per-user sequences."""
    path = Path(fmt.path)
    if not path.is_file():
        raise InteractionsError(f"interaction log {path} does not exist; pass --interactions FILE")
    rows = _read_rows(path, fmt)
    log = _sequences(rows)
    if not log:
        raise InteractionsError(f"interaction log {path} has no interactions")
    items = {item for seq in log.values() for item in seq}
    meta = load_item_metadata(fmt.items_path, fmt.item_col, items) if fmt.items_path else {}
    return InteractionLog(sequences=_ordered(log), metadata=meta)


def _read_rows(path: Path, fmt: LogFormat) -> list[tuple[str, str, float, int]]:
    """(user, item, time, line) per kept row."""
    text = path.read_text(encoding="utf-8-sig")
    kind = _detect(path, text, fmt.format)
    if kind == "movielens":
        return _movielens_rows(path, text, fmt.min_rating)
    return _named_rows(path, text, "\t" if kind == "tsv" else ",", fmt)


def _detect(path: Path, text: str, kind: str) -> str:
    if kind != "auto":
        return kind
    first = text.split("\n", 1)[0]
    fields = _split_movielens(first)
    if len(fields) == 4 and all(_is_number(f) for f in fields):
        return "movielens"  # headerless numeric rows: user item rating timestamp
    return "tsv" if path.suffix.lower() == ".tsv" or "\t" in first else "csv"


def _split_movielens(line: str) -> list[str]:
    """MovieLens 100k separates with tabs, 1M/10M with '::', 20M+ with commas."""
    for sep in ("::", "\t", ","):
        if sep in line:
            return [f.strip() for f in line.split(sep)]
    return line.split()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _movielens_rows(
    path: Path, text: str, min_rating: float | None
) -> list[tuple[str, str, float, int]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = _split_movielens(line)
        if len(fields) != 4:
            raise InteractionsError(
                f"interaction log {path}: line {number} has {len(fields)} fields {fields[:6]}, "
                f"expected 4 ({' '.join(MOVIELENS_COLUMNS)}); for other layouts pass "
                f"--format csv/tsv with a header row"
            )
        user, item, rating, stamp = fields
        if min_rating is not None and _number(rating, path, number, "rating") < min_rating:
            continue
        rows.append((user, item, _time(stamp, path, number), number))
    return rows


def _named_rows(
    path: Path, text: str, sep: str, fmt: LogFormat
) -> list[tuple[str, str, float, int]]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep)
    header = next(reader, None) or []
    wanted = [fmt.user_col, fmt.item_col, fmt.time_col]
    if fmt.rating_col is not None:
        wanted.append(fmt.rating_col)
    missing = [c for c in wanted if c not in header]
    if missing:
        raise InteractionsError(
            f"interaction log {path}: header {header} lacks column(s) {missing}; name them with "
            f"--user-col/--item-col/--time-col, or pass --format movielens for headerless "
            f"'user item rating timestamp' rows"
        )
    cols = [header.index(c) for c in wanted]
    rows = []
    for number, fields in enumerate(reader, 2):
        if not fields:
            continue
        if len(fields) != len(header):
            raise InteractionsError(
                f"interaction log {path}: line {number} has {len(fields)} fields, the header "
                f"has {len(header)}"
            )
        if fmt.min_rating is not None and fmt.rating_col is not None:
            if _number(fields[cols[3]], path, number, fmt.rating_col) < fmt.min_rating:
                continue
        when = _time(fields[cols[2]], path, number)
        rows.append((fields[cols[0]].strip(), fields[cols[1]].strip(), when, number))
    return rows


def _number(text: str, path: Path, line: int, column: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InteractionsError(
            f"interaction log {path}: line {line} has {column} {text!r}, expected a number"
        ) from None


def _time(text: str, path: Path, line: int) -> float:
    """Unix seconds (any number) or an ISO 8601 date/time."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise InteractionsError(
            f"interaction log {path}: line {line} has timestamp {text!r}; expected a number "
            f"(unix seconds) or an ISO 8601 date such as 2024-05-01T12:30:00"
        ) from None


def _sequences(rows: list[tuple[str, str, float, int]]) -> dict[str, list[str]]:
    """Per user, items sorted by (time, line): ties keep file order."""
    by_user: dict[str, list[tuple[float, int, str]]] = {}
    for user, item, when, line in rows:
        if not item or any(ch.isspace() for ch in item):
            raise InteractionsError(
                f"item id {item!r} (line {line}) is empty or holds whitespace; item ids become "
                f"single prompt words, so map them to ids without spaces"
            )
        by_user.setdefault(user, []).append((when, line, item))
    return {u: [item for _, _, item in sorted(evts)] for u, evts in by_user.items()}


def _ordered(log: dict[str, list[str]]) -> dict[str, list[str]]:
    """Users in a fixed order (numeric ids numerically), so every later stage is deterministic."""
    return {u: log[u] for u in sorted(log, key=natural_key)}


def natural_key(text: str) -> tuple[int, int | str]:
    """Sort key: numeric ids numerically, before all other ids in string order."""
    return (0, int(text)) if text.isdigit() else (1, text)


def load_item_metadata(
    path: str | Path, item_col: str, known: set[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Item attributes from a CSV/TSV with a header; `known` drops items outside the log."""
    path = Path(path)
    if not path.is_file():
        raise InteractionsError(f"item metadata file {path} does not exist; pass --items FILE")
    text = path.read_text(encoding="utf-8-sig")
    sep = "\t" if path.suffix.lower() == ".tsv" or "\t" in text.split("\n", 1)[0] else ","
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=sep)
    header = list(reader.fieldnames or [])
    if len(header) < 2:
        raise InteractionsError(
            f"item metadata file {path} has header {header}; expected an item id column and at "
            f"least one attribute, e.g. item_id,title,category"
        )
    key = item_col if item_col in header else header[0]
    meta = {row[key].strip(): {c: row[c] for c in header if c != key} for row in reader}
    if known is not None:
        unused = len(meta.keys() - known)
        meta = {k: v for k, v in meta.items() if k in known}
        if unused:
            logger.info("item metadata: %d items of %s are not in the log", unused, path)
    return meta
