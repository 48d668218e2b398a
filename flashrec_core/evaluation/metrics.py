"""Top-k metrics on unique items: Recall@k, NDCG@k and HR@k, plus the invalid-SID rate, the
duplicate rate and catalog coverage of a system's ranked answers.

Each case is a ranked list of answers; an answer is a tuple of item ids (the items of one SID),
or None for a SID the catalog lacks. The ranking that metrics see is the answers' items in
order with repeats dropped, so a system gains nothing by naming an item twice.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

KS = (1, 5, 10, 20)

Answer = tuple[str, ...] | None


@dataclass(frozen=True)
class Metrics:
    """Means over cases; `at[name][k]` for name in recall, ndcg, hr."""

    cases: int
    at: dict[str, dict[int, float]]
    invalid_rate: float
    duplicate_rate: float
    coverage: float

    def as_dict(self) -> dict[str, float | int]:
        flat: dict[str, float | int] = {"cases": self.cases}
        for name, label in (("recall", "Recall"), ("ndcg", "NDCG"), ("hr", "HR")):
            flat |= {f"{label}@{k}": v for k, v in self.at[name].items()}
        flat |= {"invalid_sid_rate": self.invalid_rate, "duplicate_rate": self.duplicate_rate,
                 "catalog_coverage": self.coverage}  # fmt: skip
        return flat


def unique_ranking(answers: Sequence[Answer]) -> list[str]:
    """The answers' items in rank order, first occurrence kept, invalid answers skipped."""
    return list(dict.fromkeys(item for a in answers if a is not None for item in a))


def case_scores(ranking: Sequence[str], relevant: Collection[str], k: int) -> tuple[float, ...]:
    """(recall, ndcg, hit) of one ranked list of unique items at cutoff k."""
    top = ranking[:k]
    hits = [r for r, item in enumerate(top) if item in relevant]
    dcg = sum(1.0 / math.log2(r + 2) for r in hits)
    idcg = sum(1.0 / math.log2(r + 2) for r in range(min(k, len(relevant))))
    return len(hits) / len(relevant), dcg / idcg, float(bool(hits))


def evaluate(
    answers: Sequence[Sequence[Answer]],
    relevant: Sequence[Collection[str]],
    catalog_size: int,
    ks: Sequence[int] = KS,
) -> Metrics:
    """Metrics of one system over all cases; coverage counts items in any top-max(ks) list."""
    if len(answers) != len(relevant) or not answers:
        raise ValueError(f"{len(answers)} answer lists for {len(relevant)} cases; need >= 1 each")
    sums = {name: dict.fromkeys(ks, 0.0) for name in ("recall", "ndcg", "hr")}
    covered: set[str] = set()
    returned = invalid = items = unique = 0
    for case, rel in zip(answers, relevant, strict=True):
        ranking = unique_ranking(case)
        for k in ks:
            for name, value in zip(("recall", "ndcg", "hr"), case_scores(ranking, rel, k)):
                sums[name][k] += value
        covered.update(ranking[: max(ks)])
        returned += len(case)
        invalid += sum(a is None for a in case)
        items += sum(len(a) for a in case if a is not None)
        unique += len(ranking)
    n = len(answers)
    at = {name: {k: v / n for k, v in per_k.items()} for name, per_k in sums.items()}
    return Metrics(
        cases=n, at=at, invalid_rate=invalid / max(1, returned),
        duplicate_rate=(items - unique) / max(1, items), coverage=len(covered) / catalog_size,
    )  # fmt: skip
