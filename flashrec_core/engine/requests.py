"""Requests and results of the offline engine (the server maps its JSON onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already tokenized) and its beam width n = number of ranked items wanted."""

    prompt_ids: tuple[int, ...]
    n: int
    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n (beam width) must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.prompt_ids:
            raise ValueError("the prompt is empty after tokenization")


@dataclass(frozen=True)
class Choice:
    """One ranked SID with its catalog items. `logprob` is the cumulative log-prob under the
    engine's normalization; `score = logprob / depth ** length_penalty`."""

    index: int
    codes: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    items: tuple[str, ...]
    logprob: float
    score: float

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "items": list(self.items),
            "logprob": self.logprob,
            "score": self.score,
        }


@dataclass(frozen=True)
class GenerationResult:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    requested: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "choices": [c.as_dict() for c in self.choices],
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "notes": self.notes,
        }
