"""Request and response bodies of the OpenAI-compatible API (pydantic: the OpenAPI schema and
validation come from these), plus FlashRec's extension fields.

Requests forbid unknown fields (OpenAI answers an unrecognized argument with a 400 too); the
OpenAI fields that mean nothing for beam search over SIDs are accepted and ignored, as listed
in docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = True


class _SearchFields(_Strict):
    """Fields shared by both generation endpoints."""

    model: str | None = None
    n: int | None = Field(default=None, ge=1, description="beam width = number of ranked choices")
    max_tokens: int | None = Field(default=None, ge=1, description="at least the SID depth")
    temperature: FiniteFloat = Field(
        default=0.0, ge=0.0, description="0: exact beam search; > 0: Gumbel top-k sampling"
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    timeout: FiniteFloat | None = Field(
        default=None, gt=0.0, description="FlashRec: seconds before the request fails with 504"
    )
    catalog: str | None = Field(
        default=None, max_length=64,
        description="FlashRec: which named catalog to search (GET /v1/catalogs); default 'default'",
    )  # fmt: skip
    exclude_items: list[str] = Field(
        default_factory=list, max_length=1_000_000,
        description="FlashRec: catalog item ids never to return (seen, bought); applied inside "
        "the search, so n other items still come back",
    )  # fmt: skip
    allow_items: list[str] | None = Field(
        default=None, max_length=1_000_000,
        description="FlashRec: return only these catalog item ids (an allow-list)",
    )  # fmt: skip
    filters: dict[str, str | int | float | bool | list[str | int | float | bool]] | None = Field(
        default=None,
        description="FlashRec: item attributes every returned item must have, from the catalog's "
        "item metadata; a list means any of these values, e.g. "
        '{"category": ["books", "music"], "in_stock": true}',
    )
    return_: Literal["sids", "items"] = Field(
        default="sids", alias="return",
        description="FlashRec: 'items' adds flashrec.items, the best n_items distinct catalog "
        "items (flattened over the ranked SIDs, de-duplicated)",
    )  # fmt: skip
    n_items: int | None = Field(
        default=None, ge=1, description="FlashRec: with return='items', how many (default n)"
    )
    max_per_prefix: int | None = Field(
        default=None, ge=1,
        description="FlashRec: at most this many choices share a first-level code (diversity); "
        "applied to the n ranked beams, so fewer than n may come back",
    )  # fmt: skip
    include_metadata: bool = Field(
        default=False,
        description="FlashRec: add each item's catalog attributes (title, category, ...) as "
        "choices[i].flashrec.item_metadata",
    )
    # OpenAI fields accepted for client compatibility; they do not change beam search.
    top_p: FiniteFloat | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


class ChatCompletionRequest(_SearchFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_SearchFields):
    # Token ids as tuples: a request in flight holds its prompt for its whole life, and the
    # cyclic collector walks every element of every list alive at each full collection (12 ms
    # with 800 prompts of 1,024 ids in flight, on the CPU machine); a tuple of ints is untracked
    # at its first collection. The JSON schema is the same (an array of integers).
    prompt: str | tuple[int, ...] | list[str] | tuple[tuple[int, ...], ...] = Field(
        description="text, token ids, or a list of either (one result set per prompt)"
    )
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChoiceExtension(BaseModel):
    """FlashRec's per-choice fields (`choices[i].flashrec`)."""

    rank: int = Field(description="0 = best")
    codes: list[int] = Field(description="the SID's code per codebook level")
    items: list[str] = Field(description="catalog item ids this SID names (empty: no catalog)")
    logprob: float = Field(description="cumulative log-prob under the engine's normalization")
    score: float = Field(description="logprob / depth ** length_penalty")
    level_logprobs: list[float] = Field(description="log-prob of each level's code")
    item_metadata: list[dict[str, Any]] | None = Field(
        default=None, description="with include_metadata: each item's catalog attributes"
    )


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop"] = "stop"
    logprobs: None = None
    flashrec: ChoiceExtension


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop"] = "stop"
    logprobs: None = None
    flashrec: ChoiceExtension


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseExtension(BaseModel):
    """FlashRec's per-response fields (`flashrec`)."""

    catalog: str | None = Field(description="the named catalog searched")
    catalog_version: int | None = Field(description="its version (changes on every reload)")
    notes: list[str] = Field(description="e.g. fewer reachable items than n")
    queue_ms: float
    prefill_ms: float
    decode_ms: float


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    flashrec: ResponseExtension


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    flashrec: ResponseExtension


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashrec"
    root: str
    max_model_len: int
    flashrec: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class CatalogUpload(_Strict):
    """POST /v1/catalogs/{name}: a catalog file the server may read, or the catalog itself."""

    path: str | None = Field(default=None, description="a catalog file on the server's disk")
    catalog: dict[str, Any] | None = Field(
        default=None, description="the catalog's JSON object, as in a .json catalog file"
    )


class CatalogInfo(BaseModel):
    name: str
    version: int
    sids: int | None
    items: int | None
    device_bytes: int
    host_bytes: int
    source: str
    loaded_at: int
    retired: bool


class CatalogList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CatalogInfo]
    live_versions: list[CatalogInfo] = Field(description="current ones and ones still in use")


class Health(BaseModel):
    status: Literal["ok", "ready", "loading", "stopping"]


class ProfileStatus(BaseModel):
    """/start_profile and /stop_profile: the window's state, and the files a stop wrote."""

    status: Literal["profiling", "stopped"]
    trace: str | None = None
    summary: str | None = None
