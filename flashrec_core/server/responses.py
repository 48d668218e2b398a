"""Engine results -> OpenAI-shaped response bodies (plain dicts: serialized once, no per-choice
model validation), with FlashRec's extension objects.

`choices[i].message.content` (chat) or `.text` (completions) is the SID text; `choices[i].flashrec`
holds the rank, codes, catalog item ids, cumulative log-prob, score and per-level log-probs.
Choices are ranked best first; with several prompts (completions) prompt p's choices follow
those of prompt p - 1 and `index` counts across all of them, as in OpenAI's API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashrec_core.engine.requests import GenerationResult


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Shaping:
    """How a request wants its answer shaped (all FlashRec extensions)."""

    metadata: bool = False  # include_metadata
    n_items: int | None = None  # return="items": this many distinct items
    max_per_prefix: int | None = None  # at most this many choices per first-level code

    @classmethod
    def of(cls, body: Any, n: int) -> Shaping:
        items = (body.n_items or n) if body.return_ == "items" else None
        return cls(body.include_metadata, items, body.max_per_prefix)


def kept_rows(result: GenerationResult, max_per_prefix: int | None) -> list[int]:
    """Rank positions kept: all of them, or at most `max_per_prefix` per first-level code."""
    if max_per_prefix is None:
        return list(range(result.codes.shape[0]))
    seen: dict[int, int] = {}
    rows = []
    for rank, first in enumerate(result.codes[:, 0].tolist()):
        if seen.get(first, 0) < max_per_prefix:
            seen[first] = seen.get(first, 0) + 1
            rows.append(rank)
    return rows


def choice_extensions(
    result: GenerationResult, rows: list[int], metadata: bool = False
) -> list[dict[str, Any]]:
    """The `flashrec` object of the choices at rank positions `rows` (with each item's catalog
    attributes when `metadata`)."""
    dec = result.decoder
    depth = result.codes.shape[1]
    divisor = depth**dec.length_penalty
    codes, lps, nodes = result.codes.tolist(), result.logprobs.tolist(), result.nodes.tolist()
    levels = result.level_logprobs.tolist() if result.level_logprobs is not None else None
    items_of = result.items_of
    out = [
        {
            "rank": rank,
            "codes": codes[rank],
            "items": list(items_of(nodes[rank])),
            "logprob": lps[rank],
            "score": lps[rank] / divisor,
            "level_logprobs": levels[rank] if levels is not None else [],
        }
        for rank in rows
    ]
    if metadata and dec.catalog is not None:
        attrs = dec.catalog.metadata
        for ext in out:
            ext["item_metadata"] = [dict(attrs.get(item, {})) for item in ext["items"]]
    return out


def item_list(
    result: GenerationResult, exts: list[dict[str, Any]], texts: list[str], shaping: Shaping
) -> tuple[list[dict[str, Any]], int]:
    """The best `n_items` distinct items over the ranked choices, and how many repeats were
    dropped (an item under several SIDs)."""
    meta = result.decoder.catalog.metadata if result.decoder.catalog is not None else {}
    seen: set[str] = set()
    out, dropped = [], 0
    for ext, text in zip(exts, texts):
        for item in ext["items"]:
            if item in seen:
                dropped += 1
                continue
            if shaping.n_items is not None and len(out) == shaping.n_items:
                return out, dropped
            seen.add(item)
            entry = {"item": item, "rank": ext["rank"], "sid": text, "logprob": ext["logprob"],
                     "score": ext["score"]}  # fmt: skip
            if shaping.metadata:
                entry["metadata"] = dict(meta.get(item, {}))
            out.append(entry)
    return out, dropped


def _shaped(result: GenerationResult, shaping: Shaping) -> tuple[list[str], list[dict[str, Any]]]:
    exts = choice_extensions(result, kept_rows(result, shaping.max_per_prefix), shaping.metadata)
    return result.decoder.layout.format_rows([ext["codes"] for ext in exts]), exts


def usage(results: Sequence[GenerationResult]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def extension(results: Sequence[GenerationResult]) -> dict[str, Any]:
    timed = [r.timings for r in results if r.timings is not None]

    def worst(field: str) -> float:
        return round(1e3 * max((getattr(t, field) for t in timed), default=0.0), 3)

    name, version = results[0].catalog if results and results[0].catalog else (None, None)
    return {
        "catalog": name,
        "catalog_version": version,
        "notes": [note for r in results for note in r.notes],
        "queue_ms": worst("queue_s"),
        "prefill_ms": worst("prefill_s"),
        "decode_ms": worst("decode_s"),
    }


def chat_completion(
    response_id: str, model: str, result: GenerationResult, shaping: Shaping = Shaping()
) -> dict[str, Any]:
    texts, exts = _shaped(result, shaping)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "logprobs": None,
            "flashrec": ext,
        }
        for i, (text, ext) in enumerate(zip(texts, exts))
    ]
    ext = extension([result])
    if shaping.n_items is not None:
        ext["items"], ext["deduplicated_items"] = item_list(result, exts, texts, shaping)
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([result]),
        "flashrec": ext,
    }


def completion(
    response_id: str, model: str, results: Sequence[GenerationResult], shaping: Shaping = Shaping()
) -> dict[str, Any]:
    choices, items, dropped = [], [], 0
    for result in results:
        texts, exts = _shaped(result, shaping)
        for text, ext in zip(texts, exts):
            choices.append({
                "index": len(choices), "text": text, "finish_reason": "stop", "logprobs": None,
                "flashrec": ext,
            })  # fmt: skip
        if shaping.n_items is not None:
            listed, repeats = item_list(result, exts, texts, shaping)
            items.append(listed)
            dropped += repeats
    ext = extension(results)
    if shaping.n_items is not None:
        ext["items"], ext["deduplicated_items"] = items, dropped  # one list per prompt
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results),
        "flashrec": ext,
    }


def chat_stream_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat completion as stream chunks: every ranked choice in one chunk (beam search
    has no partial tokens), then a usage chunk with no choices."""
    choices = [
        {
            "index": c["index"],
            "delta": {"role": "assistant", "content": c["message"]["content"]},
            "finish_reason": "stop",
            "logprobs": None,
            "flashrec": c["flashrec"],
        }
        for c in body["choices"]
    ]
    return _chunks(body, "chat.completion.chunk", choices)


def completion_stream_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    return _chunks(body, "text_completion", body["choices"])


def _chunks(body: dict[str, Any], kind: str, choices: list[Any]) -> list[dict[str, Any]]:
    base = {"id": body["id"], "object": kind, "created": body["created"], "model": body["model"]}
    return [
        {**base, "choices": choices, "flashrec": body["flashrec"]},
        {**base, "choices": [], "usage": body["usage"]},
    ]
