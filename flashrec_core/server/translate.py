"""API request bodies -> engine requests, with every check that names the field at fault.

Used by the HTTP server and by the offline batch command (`flashrec generate --input`), so a
line of a batch file is checked exactly like an HTTP request.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flashrec_core.engine.catalogs import CatalogNotFoundError
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.handles import RequestRejectedError
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.search.filters import FilterError
from flashrec_core.server.errors import APIError
from flashrec_core.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _SearchFields,
)


@dataclass(frozen=True)
class Defaults:
    """Server-side defaults for fields a request leaves out."""

    n: int = 10
    timeout_s: float | None = None


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def chat_request(
    engine: Engine, body: ChatCompletionRequest, defaults: Defaults
) -> GenerationRequest:
    _check_max_tokens(engine, body.max_completion_tokens, "max_completion_tokens")
    messages = [
        {"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)
    ]
    try:
        ids = engine.encode_prompt(messages=messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return _request(engine, body, ids, defaults, "messages")


def completion_requests(
    engine: Engine, body: CompletionRequest, defaults: Defaults
) -> list[GenerationRequest]:
    prompts: Sequence[str | Sequence[int]]
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts = [body.prompt]  # one prompt  # type: ignore[list-item]
    else:
        prompts = body.prompt  # type: ignore[assignment]
    if not prompts:
        raise bad_request("prompt is empty", "prompt")
    out = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        out.append(_request(engine, body, _completion_ids(engine, p, param), defaults, param))
    return out


def _completion_ids(engine: Engine, prompt: str | Sequence[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        try:
            return engine.encode_prompt(prompt=prompt, raw=True)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None
    if not prompt:
        raise bad_request("the token-id prompt is empty", param)
    vocab = engine.vocab_size
    if not _below(prompt, vocab):  # the loop only to name the bad one
        j, t = next((j, t) for j, t in enumerate(prompt) if not 0 <= t < vocab)
        raise bad_request(f"token id {t} is outside the vocabulary 0..{vocab - 1}", f"{param}[{j}]")
    return engine.with_sid_begin(prompt)


def _below(ids: Sequence[int], bound: int) -> bool:
    """Whether every id is in 0..bound-1. Packing into unsigned 64-bit words checks >= 0 in
    one C pass, and numpy's max the bound: 7 us for 1,024 ids against 23 us for Python's
    min() and max(), time the event loop thread holds the GIL."""
    try:
        words = array.array("Q", ids)  # OverflowError: a negative id, or one past 64 bits
    except OverflowError:
        return False
    return int(np.frombuffer(words, dtype=np.uint64).max()) < bound


def _message_text(message: ChatMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _check_max_tokens(engine: Engine, value: int | None, param: str) -> None:
    depth = engine.sid_depth
    if value is not None and value < depth:
        raise bad_request(
            f"{param}={value} is shorter than the SID depth {depth}; a recommendation takes "
            f"{depth} tokens (leave it out or send >= {depth})", param,
        )  # fmt: skip


def _request(
    engine: Engine, body: _SearchFields, ids: list[int], defaults: Defaults, prompt_param: str
) -> GenerationRequest:
    _check_max_tokens(engine, body.max_tokens, "max_tokens")
    n = body.n if body.n is not None else defaults.n
    try:
        version = engine.catalogs.get(body.catalog)
    except CatalogNotFoundError as exc:
        raise APIError(404, exc.args[0], "catalog", "catalog_not_found") from None
    catalog = version.catalog
    if catalog is not None and n > len(catalog):
        raise bad_request(
            f"n={n} exceeds the {len(catalog)} SIDs in the catalog; ask for at most {len(catalog)}",
            "n",
        )
    try:
        item_filter = engine.create_filter(
            body.exclude_items, body.allow_items, body.filters, version
        )
    except FilterError as exc:
        raise bad_request(str(exc), exc.param) from None
    try:
        req = GenerationRequest(tuple(ids), n, body.temperature, body.seed, item_filter, version)
        engine.loop.check(req)
    except RequestRejectedError as exc:
        param = prompt_param if exc.param == "messages" else exc.param
        code = "context_length_exceeded" if exc.param == "messages" else "invalid_value"
        raise bad_request(str(exc), param, code) from None
    except ValueError as exc:
        raise bad_request(str(exc), None) from None
    return req
