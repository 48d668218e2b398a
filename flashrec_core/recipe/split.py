"""Chronological leave-last-out split: per user, the last item is the test target, the one before
it the validation target, the rest training data (the protocol of SASRec, BERT4Rec and TIGER)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIN_HELD_OUT_LENGTH = 3
"""Users with fewer interactions lend all of them to training and are not evaluated."""


@dataclass(frozen=True)
class HeldOut:
    """One evaluation case: a user's history (oldest first) and the item that came next."""

    user: str
    history: tuple[str, ...]
    target: str


@dataclass(frozen=True)
class Split:
    train: dict[str, list[str]]
    valid: list[HeldOut]
    test: list[HeldOut]

    def cases(self, which: Literal["valid", "test"]) -> list[HeldOut]:
        return self.valid if which == "valid" else self.test


def leave_last_out(sequences: dict[str, list[str]]) -> Split:
    """Split each user's chronological sequence; the test history includes the validation item."""
    train, valid, test = {}, [], []
    for user, seq in sequences.items():
        if len(seq) < MIN_HELD_OUT_LENGTH:
            train[user] = list(seq)
            continue
        train[user] = list(seq[:-2])
        valid.append(HeldOut(user, tuple(seq[:-2]), seq[-2]))
        test.append(HeldOut(user, tuple(seq[:-1]), seq[-1]))
    return Split(train, valid, test)
