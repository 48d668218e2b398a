"""Turning a finished wave's beams into per-request results with array operations.

One device-to-host copy of the wave's codes, catalog rows and scores; ranking, dead-beam removal
and the validity check run as numpy ops over all rows at once. No Python object is made per beam
here (the engine thread runs this); `GenerationResult.choices` makes those lazily elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashrec_core.engine.beam_wave import WaveOutput
from flashrec_core.engine.requests import GenerationRequest, GenerationResult, ResultDecoder


@dataclass(frozen=True)
class WaveResults:
    results: list[GenerationResult]
    invalid: int
    """Returned beams whose codes are not the catalog SID of their row (must stay 0)."""


def assemble_results(
    out: WaveOutput,
    requests: Sequence[GenerationRequest],
    cached_lens: Sequence[int],
    decoder: ResultDecoder,
) -> WaveResults:
    """Per request, its live beams ranked by log-prob (ties: lower row first)."""
    host = torch.cat([out.codes, out.nodes[:, None]], dim=1).cpu().numpy()
    paths = out.path_scores.float().cpu().numpy()
    scores = paths[:, -1]
    codes, nodes = host[:, :-1], host[:, -1]
    widths = np.array([r.n for r in requests], dtype=np.int64)
    row_request = np.repeat(np.arange(len(requests)), widths)
    # lexsort: last key first -> by request, then by descending score, then by row
    order = np.lexsort((np.arange(len(scores)), -scores, row_request))
    order = order[np.isfinite(scores[order])]
    counts = np.bincount(row_request[order], minlength=len(requests))
    invalid = 0
    catalog = decoder.catalog
    if catalog is not None and order.size:
        invalid = int((catalog.codes[nodes[order]] != codes[order]).any(axis=1).sum())
    # per-level log-probs: differences of the cumulative path scores
    levels = np.diff(paths, axis=1, prepend=np.zeros((len(paths), 1), dtype=paths.dtype))
    results = []
    for req, rows, cached in zip(requests, np.split(order, np.cumsum(counts)[:-1]), cached_lens):
        notes = []
        if rows.size < req.n:
            notes.append(f"only {rows.size} valid items reachable; requested n={req.n}")
        results.append(
            GenerationResult(
                codes[rows],
                scores[rows],
                nodes[rows],
                len(req.prompt_ids),
                req.n,
                decoder,
                level_logprobs=levels[rows],
                cached_tokens=cached,
                notes=notes,
                item_filter=req.item_filter,
                catalog=(req.catalog.name, req.catalog.version) if req.catalog else None,
            )  # fmt: skip
        )
    return WaveResults(results, invalid)
