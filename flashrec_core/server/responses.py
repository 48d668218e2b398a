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
from typing import Any

from flashrec_core.engine.requests import GenerationResult


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_extensions(result: GenerationResult, metadata: bool = False) -> list[dict[str, Any]]:
    """The `flashrec` object of each choice, from the result's arrays (with each item's catalog
    attributes when `metadata`)."""
    dec = result.decoder
    depth = result.codes.shape[1]
    divisor = depth**dec.length_penalty
    levels = result.level_logprobs.tolist() if result.level_logprobs is not None else None
    out = []
    for rank, (codes, lp, node) in enumerate(
        zip(result.codes.tolist(), result.logprobs.tolist(), result.nodes.tolist())
    ):
        out.append({
            "rank": rank,
            "codes": codes,
            "items": list(result.items_of(node)),
            "logprob": lp,
            "score": lp / divisor,
            "level_logprobs": levels[rank] if levels is not None else [],
        })  # fmt: skip
    if metadata and dec.catalog is not None:
        attrs = dec.catalog.metadata
        for ext in out:
            ext["item_metadata"] = [dict(attrs.get(item, {})) for item in ext["items"]]
    return out


def sid_texts(result: GenerationResult) -> list[str]:
    fmt = result.decoder.layout.format
    return [fmt(codes) for codes in result.codes.tolist()]


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

    return {
        "notes": [note for r in results for note in r.notes],
        "queue_ms": worst("queue_s"),
        "prefill_ms": worst("prefill_s"),
        "decode_ms": worst("decode_s"),
    }


def chat_completion(
    response_id: str, model: str, result: GenerationResult, metadata: bool = False
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "logprobs": None,
            "flashrec": ext,
        }
        for i, (text, ext) in enumerate(zip(sid_texts(result), choice_extensions(result, metadata)))
    ]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([result]),
        "flashrec": extension([result]),
    }


def completion(
    response_id: str, model: str, results: Sequence[GenerationResult], metadata: bool = False
) -> dict[str, Any]:
    choices = []
    for result in results:
        for text, ext in zip(sid_texts(result), choice_extensions(result, metadata)):
            choices.append({
                "index": len(choices), "text": text, "finish_reason": "stop", "logprobs": None,
                "flashrec": ext,
            })  # fmt: skip
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results),
        "flashrec": extension(results),
    }


def chat_stream_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat completion as stream chunks: every ranked choice in one chunk (beam search
    has no partial tokens), then a usage chunk with no choices."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}  # fmt: skip
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
    return [
        {**base, "choices": choices, "flashrec": body["flashrec"]},
        {**base, "choices": [], "usage": body["usage"]},
    ]


def completion_stream_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"id": body["id"], "object": "text_completion", "created": body["created"],
            "model": body["model"]}  # fmt: skip
    return [
        {**base, "choices": body["choices"], "flashrec": body["flashrec"]},
        {**base, "choices": [], "usage": body["usage"]},
    ]
