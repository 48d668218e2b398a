"""Requests and results of the engine (the server maps its JSON onto these).

A result holds its beams as arrays (codes, log-probs, catalog rows), assembled per wave with
array operations on the engine thread; `choices` turns them into one `Choice` per beam lazily,
on whichever thread reads them (an HTTP handler, the CLI), never on the engine thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flashrec_core.engine.catalogs import CatalogVersion
    from flashrec_core.search.catalog import Catalog
    from flashrec_core.search.filters import ItemFilter
    from flashrec_core.search.sid_layout import SidLayout


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already tokenized) and its beam width n = number of ranked items wanted."""

    prompt_ids: tuple[int, ...]
    n: int
    temperature: float = 0.0
    seed: int | None = None
    item_filter: ItemFilter | None = None
    """Which catalog items this request may return (applied inside the search)."""
    catalog: CatalogVersion | None = None
    """The catalog version it searches (bound when the request is made; None: `Engine.generate`
    binds the current default version)."""

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n (beam width) must be an integer >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not self.prompt_ids:
            raise ValueError("the prompt is empty after tokenization")


@dataclass(frozen=True)
class Choice:
    """One ranked SID with its catalog items. `logprob` is the cumulative log-prob under the
    engine's normalization; `score = logprob / depth ** length_penalty`."""

    index: int
    codes: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    items: tuple[str, ...]
    logprob: float
    score: float

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "items": list(self.items),
            "logprob": self.logprob,
            "score": self.score,
        }


@dataclass(frozen=True)
class ResultDecoder:
    """What turns a beam's codes and catalog row into text and items (shared by an engine)."""

    layout: SidLayout
    catalog: Catalog | None
    length_penalty: float


@dataclass(frozen=True)
class RequestTimings:
    """Seconds a request spent queued, in its prefill + first selection, and in beam steps
    (host clock at step boundaries)."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """The ranked beams of one request, best first (dead beams dropped)."""

    codes: np.ndarray  # int64 [k, depth]
    logprobs: np.ndarray  # float32 [k] cumulative log-probs
    nodes: np.ndarray  # int64 [k] catalog rows
    prompt_tokens: int
    requested: int
    decoder: ResultDecoder
    level_logprobs: np.ndarray | None = None  # float32 [k, depth] log-prob of each level's code
    cached_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    timings: RequestTimings | None = None
    item_filter: ItemFilter | None = None
    catalog: tuple[str, int] | None = None  # (name, version) of the catalog searched

    def items_of(self, node: int) -> tuple[str, ...]:
        """The catalog items of a returned SID that this request's filter keeps."""
        catalog = self.decoder.catalog
        if catalog is None:
            return ()
        items = catalog.items[node]
        keep = self.item_filter
        return items if keep is None else tuple(i for i in items if keep.keeps(i))

    @property
    def completion_tokens(self) -> int:
        return int(self.codes.shape[0] * self.codes.shape[1])

    @cached_property
    def choices(self) -> list[Choice]:
        dec = self.decoder
        depth = self.codes.shape[1]
        tokens = self.codes + np.asarray(dec.layout.level_starts[:depth], dtype=np.int64)
        divisor = depth**dec.length_penalty
        out = []
        for i, (codes, toks, lp, node) in enumerate(
            zip(self.codes.tolist(), tokens.tolist(), self.logprobs.tolist(), self.nodes.tolist())
        ):
            items = self.items_of(node)
            text = dec.layout.format(codes)
            out.append(Choice(i, tuple(codes), tuple(toks), text, items, lp, lp / divisor))
        return out

    def as_dict(self) -> dict:
        return {
            "choices": [c.as_dict() for c in self.choices],
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "cached_tokens": self.cached_tokens,
            },
            "notes": self.notes,
        }
