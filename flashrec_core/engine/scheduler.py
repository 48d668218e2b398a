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


Piece = tuple[int, int, int]
"""(request, start, end): the prompt tokens [start, end) of one request, in one forward."""


def prefill_chunks(
    lengths: Sequence[int], starts: Sequence[int], max_tokens: int
) -> list[list[Piece]]:
    """The forwards of one wave's prefill: request i computes its tokens [starts[i],
    lengths[i]) (after its cached prefix), in order, at most `max_tokens` new tokens a forward.
    A prompt may span forwards: its later piece attends to the KV the earlier one wrote, like a
    cached prefix. `max_tokens` 0: one forward. The activations of a forward grow with its
    tokens, so a wave's prefill stays within a bound whatever its size."""
    if max_tokens <= 0:
        whole = [(i, s, n) for i, (s, n) in enumerate(zip(starts, lengths))]
        return [whole] if whole else []
    chunks: list[list[Piece]] = []
    chunk: list[Piece] = []
    room = max_tokens
    for i, (start, length) in enumerate(zip(starts, lengths)):
        while start < length:
            take = min(length - start, room)
            chunk.append((i, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                chunks.append(chunk)
                chunk, room = [], max_tokens
    if chunk:
        chunks.append(chunk)
    return chunks
