"""Warm-up before /ready: run each configured beam width once at every request count the CUDA
graphs are captured for, so first traffic replays graphs instead of capturing them (on CPU,
where there are no graphs, one request per width)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tqdm import tqdm

from flashrec_core.engine.cuda_graph import capture_request_counts
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.requests import GenerationRequest

logger = logging.getLogger("flashrec.server")


def warm_up(engine: Engine, widths: Sequence[int]) -> None:
    limits = engine.loop.limits
    catalog = engine.catalog
    usable = [
        n for n in widths
        if n <= limits.max_wave_rows and (catalog is None or n <= len(catalog))
    ]  # fmt: skip
    skipped = sorted(set(widths) - set(usable))
    if skipped:
        logger.warning("warm-up skips n=%s (over the row budget or the catalog size)", skipped)
    prompt = tuple(engine.with_sid_begin([_any_token(engine)]))
    plan = [
        (n, count)
        for n in usable
        for count in (
            capture_request_counts(n, limits.max_wave_rows) if engine.wave.graphs else [1]
        )
    ]
    for n, count in tqdm(plan, desc="warm-up", unit="wave", disable=not plan):
        engine.generate([GenerationRequest(prompt, n)] * count)


def _any_token(engine: Engine) -> int:
    """A prompt token for warm-up: the tokenizer's first ordinary token."""
    tok = engine.tokenizer
    for cand in (tok.bos_token_id, tok.unk_token_id, 0):
        if cand is not None:
            return int(cand)
    return 0
