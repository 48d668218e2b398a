"""Packing requests into beam waves: every request of a wave shares each forward step.

A wave is bounded by beam rows (`max_wave_rows`: activations and the selection grid grow with
them), by request-table rows, and by KV slots (prompt + n x (depth - 1) decode slots per
request). Requests are packed greedily in arrival order, so results keep a stable latency order.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.kvcache import OutOfSlotsError


def plan_waves(
    requests: Sequence[GenerationRequest],
    *,
    depth: int,
    max_rows: int,
    max_requests: int,
    kv_slots: int,
) -> list[list[int]]:
    """Indices of `requests` per wave, in arrival order."""
    waves: list[list[int]] = []
    rows = slots = 0
    for i, req in enumerate(requests):
        need = len(req.prompt_ids) + req.n * (depth - 1)
        if req.n > max_rows or need > kv_slots:
            raise OutOfSlotsError(
                f"request {i} needs {req.n} beam rows and {need} KV slots; the engine allows "
                f"{max_rows} rows per wave (--max-wave-rows) and {kv_slots} KV slots "
                "(--kv-cache-tokens / --mem-fraction)"
            )
        full = rows + req.n > max_rows or slots + need > kv_slots
        if not waves or full or len(waves[-1]) == max_requests:
            waves.append([])
            rows = slots = 0
        waves[-1].append(i)
        rows += req.n
        slots += need
    return waves


def prefill_chunks(new_tokens: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Contiguous request ranges [start, end) of one wave's prefill, each of at most
    `max_tokens` new tokens (a longer request forms a range alone); one range when
    `max_tokens` is 0. Each range is one forward, so the prefill's activations stay bounded
    by `max_tokens` rows whatever the wave's size."""
    if max_tokens <= 0 or sum(new_tokens) <= max_tokens:
        return [(0, len(new_tokens))] if new_tokens else []
    ranges: list[tuple[int, int]] = []
    start = total = 0
    for i, tokens in enumerate(new_tokens):
        if i > start and total + tokens > max_tokens:
            ranges.append((start, i))
            start, total = i, 0
        total += tokens
    ranges.append((start, len(new_tokens)))
    return ranges
