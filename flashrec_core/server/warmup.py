"""Warm-up before /ready and before a reloaded catalog is swapped in: run each configured beam
width once at every request count the CUDA graphs are captured for, unfiltered and (with a
catalog) filtered, for each catalog version, so traffic replays graphs instead of capturing them
(and with merged beam steps, the graphs of small waves stepping together, `merged_shapes`, and
of a small prefill carrying their step, `capture_mixed_steps`).
The waves go through the engine loop like any request, so a reload's warm-up interleaves with
live traffic. Prefill graphs do not depend on the catalog: the first warm-up captures them all.
On CPU, where there are no graphs, one request per width."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from tqdm import tqdm

from flashrec_core.engine.catalogs import CatalogVersion
from flashrec_core.engine.cuda_graph import capture_request_counts
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.handles import DeviceMemoryError
from flashrec_core.engine.requests import GenerationRequest

logger = logging.getLogger("flashrec.server")


def warm_up(
    engine: Engine, widths: Sequence[int], versions: Sequence[CatalogVersion] | None = None,
    progress: bool = True,
) -> int:  # fmt: skip
    """Warm `widths` on `versions` (default: every current catalog); returns the waves planned
    (with any that a lowered beam-row budget skipped)."""
    limits, graphs = engine.loop.limits, engine.wave.graphs is not None
    prompt = tuple(engine.with_sid_begin([_any_token(engine)]))
    plan: list[tuple[GenerationRequest, list[int]]] = []
    for version in versions if versions is not None else engine.catalogs.current():
        sids = len(version.catalog) if version.catalog is not None else None
        usable = [n for n in widths if n <= limits.max_wave_rows and (sids is None or n <= sids)]
        skipped = sorted(set(widths) - set(usable))
        if skipped:
            logger.warning(
                "warm-up of catalog %s skips n=%s (over the row budget or the catalog size)",
                version.name, skipped,
            )  # fmt: skip
        filters = [None] + ([version.index.allow_all()] if graphs and version.index else [])
        for n in usable:
            counts = warm_counts(n, limits.max_wave_rows) if graphs else [1]
            for item_filter in filters:
                request = GenerationRequest(prompt, n, item_filter=item_filter, catalog=version)
                plan.append((request, counts))
    prefill = engine.wave.prefill_graphs
    if prefill is not None and versions is None:
        engine.loop.call(lambda: prefill.capture_all(progress))  # on the engine thread
    planned = [(request.n, request.catalog) for request, counts in plan]
    _capture_step_graphs(engine, planned, "merged beam-step", engine.wave.capture_merged_steps)
    waves = sum(len(counts) for _, counts in plan)
    with tqdm(total=waves, desc="warm-up", unit="wave", disable=not (waves and progress)) as bar:
        for request, counts in plan:
            warm_ladder(engine, request, counts, bar.update)
    # after the ladder: they are smaller than its largest waves' graphs (`warm_counts`)
    _capture_step_graphs(engine, planned, "mixed prefill-step", engine.wave.capture_mixed_steps)
    return waves


def warm_ladder(
    engine: Engine, request: GenerationRequest, counts: list[int], done: Callable[[], object]
) -> None:
    """A wave of `request` at each of `counts` (largest first), `done` after each. A wave whose
    beam step runs out of device memory lowers the loop's beam-row budget to the next count down
    (with a warning) instead of failing the warm-up: traffic would meet the same shortfall in an
    eager step (the graph's capture failed with it), and a server left unready serves nobody.
    Waves over a budget lowered this way are skipped; the smallest count failing still fails."""
    for i, count in enumerate(counts):
        rows = count * request.n
        if rows <= engine.loop.limits.max_wave_rows:
            try:
                engine.generate([request] * count)
            except DeviceMemoryError as exc:
                if not exc.retry or i + 1 == len(counts):
                    raise
                cap = counts[i + 1] * request.n
                engine.loop.limits = replace(engine.loop.limits, max_wave_rows=cap)
                logger.warning(
                    "warm-up: a wave of %d requests x n=%d (%d beam rows) ran out of device memory;"
                    " waves are now capped at %d beam rows (lower --mem-fraction to keep "
                    "--max-wave-rows): %s", count, request.n, rows, cap, exc,
                )  # fmt: skip
        done()


def _capture_step_graphs(
    engine: Engine, planned: Sequence[tuple[int, CatalogVersion | None]], what: str,
    capture: Callable[[int, CatalogVersion | None], int],
) -> None:  # fmt: skip
    """With merged beam steps on graphs: `capture(n, version)`, the merged step graphs
    (`BeamWave.capture_merged_steps`) or the mixed graphs of a prefill carrying beam steps
    (`capture_mixed_steps`), of every width on every catalog version planned, on the engine
    thread. Which shapes traffic meets depends on how many waves are in flight and at which
    levels, which warm-up waves run one at a time never produce."""
    done, graphs = set(), 0
    for n, version in planned:
        key = (n, version.version if version is not None else None)
        if key not in done:
            done.add(key)
            graphs += engine.loop.call(lambda n=n, version=version: capture(n, version))
    if graphs:
        logger.info("warm-up: %d %s graphs captured for n=%s", graphs, what,
                    sorted({n for n, _ in done}))  # fmt: skip


def warm_counts(width: int, max_rows: int) -> list[int]:
    """The request counts of `width`'s beam-step graphs, largest first. The graphs share one
    memory pool: what a capture frees, a later capture can reuse only if it needs no larger
    blocks, so smallest-first grows the pool by every capture's buffers (5.0 GiB of graph pools at
    n=50 on an H100, where the last capture ran out of memory; docs/benchmarks.md, session 21),
    and largest-first lets the smaller ones fit in what the first left (the prefill graphs and
    vLLM capture the same way)."""
    return sorted(capture_request_counts(width, max_rows), reverse=True)


def _any_token(engine: Engine) -> int:
    """A prompt token for warm-up: the tokenizer's first ordinary token."""
    tok = engine.tokenizer
    for cand in (tok.bos_token_id, tok.unk_token_id, 0):
        if cand is not None:
            return int(cand)
    return 0


def warm_catalog(engine: Engine, version: CatalogVersion, widths: Sequence[int]) -> None:
    """Capture a newly loaded catalog version's graphs before it is swapped in (no capture storm
    on the first requests after the swap). Nothing to do without CUDA graphs; a failure is
    logged and the version served unwarmed (its graphs then capture on first use)."""
    if engine.wave.graphs is None:
        return
    try:
        warm_up(engine, widths, [version], progress=False)
    except Exception:  # the catalog is good: serve it
        logger.exception("warm-up of catalog %s failed; swapping it in unwarmed", version.name)
