"""`flashrec eval` metrics against a brute-force computation, and the baselines by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashrec_core.evaluation import (
    KS,
    CooccurrenceBaseline,
    PopularityBaseline,
    evaluate,
    run_eval,
)
from flashrec_core.recipe import HeldOut, Split

TOL = 1e-12  # the same float sums in another order: a few ulps at most


def _brute_force(answers, relevant, catalog_size, k):
    """Straight from the definitions, one case and one cutoff at a time."""
    recall = ndcg = hr = 0.0
    for case, rel in zip(answers, relevant):
        ranking = []
        for answer in case:
            for item in answer or ():
                if item not in ranking:
                    ranking.append(item)
        top = ranking[:k]
        found = [item for item in top if item in rel]
        recall += len(found) / len(rel)
        hr += 1.0 if found else 0.0
        dcg = sum(1 / math.log2(top.index(item) + 2) for item in found)
        ideal = sum(1 / math.log2(r + 2) for r in range(min(k, len(rel))))
        ndcg += dcg / ideal
    n = len(answers)
    return recall / n, ndcg / n, hr / n


def _fixture(seed: int = 0, cases: int = 200, items: int = 60):
    """Rankings with repeats, multi-item SIDs and invalid SIDs; 1 to 3 relevant items."""
    rng = np.random.default_rng(seed)
    names = [f"i{j}" for j in range(items)]
    answers, relevant = [], []
    for _ in range(cases):
        case = []
        for _ in range(int(rng.integers(5, 30))):
            roll = rng.random()
            if roll < 0.1:
                case.append(None)
            else:
                size = 2 if roll > 0.9 else 1
                case.append(tuple(rng.choice(names, size=size, replace=False).tolist()))
        answers.append(case)
        relevant.append(set(rng.choice(names, size=int(rng.integers(1, 4)), replace=False)))
    return answers, relevant, items


def test_metrics_match_brute_force() -> None:
    answers, relevant, size = _fixture()
    metrics = evaluate(answers, relevant, size)
    for k in KS:
        recall, ndcg, hr = _brute_force(answers, relevant, size, k)
        assert metrics.at["recall"][k] == pytest.approx(recall, abs=TOL)
        assert metrics.at["ndcg"][k] == pytest.approx(ndcg, abs=TOL)
        assert metrics.at["hr"][k] == pytest.approx(hr, abs=TOL)
    flat = [a for case in answers for a in case]
    assert metrics.invalid_rate == pytest.approx(sum(a is None for a in flat) / len(flat), abs=TOL)
    items = [i for a in flat if a is not None for i in a]
    unique = sum(len({i for a in case if a for i in a}) for case in answers)
    assert metrics.duplicate_rate == pytest.approx((len(items) - unique) / len(items), abs=TOL)
    covered = set()
    for case in answers:
        covered |= set(list(dict.fromkeys(i for a in case if a for i in a))[: max(KS)])
    assert metrics.coverage == pytest.approx(len(covered) / size, abs=TOL)


def test_one_case_by_hand() -> None:
    answers = [[("a",), None, ("b", "a"), ("c",)]]  # unique ranking: a, b, c
    m = evaluate(answers, [{"b", "z"}], catalog_size=10, ks=(1, 5))
    assert m.at["recall"] == {1: 0.0, 5: 0.5}
    assert m.at["hr"] == {1: 0.0, 5: 1.0}
    assert m.at["ndcg"][5] == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)), abs=TOL)
    assert (m.invalid_rate, m.duplicate_rate, m.coverage) == (0.25, 0.25, 0.3)


def test_baselines() -> None:
    train = {"u1": ["a", "b", "c", "a", "b"], "u2": ["b", "d", "a", "b"]}
    assert PopularityBaseline(train).recommend(["x"], 3) == [("b",), ("a",), ("c",)]
    cooc = CooccurrenceBaseline(train)  # a -> b three times; b -> c, d once each
    assert cooc.recommend(["c", "a"], 2) == [("b",), ("a",)], "successors, then popular items"
    assert cooc.recommend(["b"], 4) == [("c",), ("d",), ("b",), ("a",)]
    assert cooc.recommend(["unseen"], 2) == [("b",), ("a",)]


class _FakeEngine:
    """Answers through the public make_request/generate interface, like the engine."""

    class catalog:  # noqa: N801
        num_items = 4

        @staticmethod
        def row_of(codes):
            return 0 if codes[0] >= 0 else -1

    def make_request(self, prompt, n):
        return (prompt, n)

    def generate(self, requests):
        from types import SimpleNamespace as NS

        def choice(item, code):
            return NS(items=(item,), codes=(code,))

        return [NS(choices=[choice(p.split()[-1], 0), choice("zz", -1), choice("c", 0)][:n])
                for p, n in requests]  # fmt: skip


def test_run_eval_feeds_the_last_history_items_and_scores_every_system() -> None:
    split = Split(
        train={"u": ["a", "b", "c"]},
        valid=[],
        test=[HeldOut("u", ("a", "b", "c"), "c"), HeldOut("v", ("c", "a"), "a")],
    )
    report = run_eval(_FakeEngine(), split, "test", source="fixture", max_history=2, n=20,
                      progress=False)  # fmt: skip
    engine = report.systems["flashrec"]
    assert engine.at["hr"][1] == 1.0 and engine.invalid_rate == pytest.approx(1 / 3, abs=TOL)
    assert set(report.as_dict()["systems"]) == {"flashrec", "popularity", "cooccurrence"}
    assert "Recall@10" in report.table()
    with pytest.raises(ValueError, match="-n 5 is below the largest cutoff 20"):
        run_eval(_FakeEngine(), split, "test", source="f", max_history=2, n=5, progress=False)
