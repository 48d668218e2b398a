"""Turning a finished wave's beams into per-request results with array operations.

One device-to-host copy of the wave's codes, catalog rows and scores (`copy_to_host`: on CUDA
non-blocking into pinned memory, so the engine thread queues the next GPU work before it waits
for the beams); ranking, dead-beam removal and the validity check run as numpy ops over all rows
at once. No Python object is made per beam here (the engine thread runs this);
`GenerationResult.choices` makes those lazily elsewhere.
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


@dataclass(frozen=True)
class HostBeams:
    """A finished wave's beams on their way to the host: codes with each beam's catalog row as
    a last column, and the cumulative log-prob after each level."""

    codes_nodes: torch.Tensor
    path_scores: torch.Tensor
    copied: torch.cuda.Event | None  # recorded after the copies on CUDA; None: on the host

    def ready(self) -> bool:
        """Whether the copies have landed (reading `arrays()` would not wait)."""
        return self.copied is None or self.copied.query()

    def wait(self) -> None:
        """Block until the copies have landed."""
        if self.copied is not None:
            self.copied.synchronize()

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The two as numpy arrays, once the copies have landed."""
        self.wait()
        return self.codes_nodes.numpy(), self.path_scores.numpy()


def copy_to_host(out: WaveOutput) -> HostBeams:
    """Start the wave's device-to-host copy. On CUDA it is queued behind the wave's last step
    and does not wait for it; reading `arrays()` does."""
    both = torch.cat([out.codes, out.nodes[:, None]], dim=1)
    paths = out.path_scores.float()
    if not both.is_cuda:
        return HostBeams(both, paths, None)
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
    host_paths = torch.empty(paths.shape, dtype=paths.dtype, pin_memory=True)
    host.copy_(both, non_blocking=True)
    host_paths.copy_(paths, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return HostBeams(host, host_paths, copied)


def assemble_results(
    beams: HostBeams,
    requests: Sequence[GenerationRequest],
    cached_lens: Sequence[int],
    decoder: ResultDecoder,
) -> WaveResults:
    """Per request, its live beams ranked by log-prob (ties: lower row first)."""
    host, paths = beams.arrays()
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
