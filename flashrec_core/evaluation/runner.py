"""`flashrec eval`: held-out histories through the engine's constrained beam search, and the
baselines on the same split, scored by the same metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashrec_core.evaluation.baselines import CooccurrenceBaseline, PopularityBaseline
from flashrec_core.evaluation.metrics import KS, Answer, Metrics, evaluate
from flashrec_core.recipe.split import HeldOut, Split
from flashrec_core.recipe.tokenizer import history_prompt

ENGINE = "flashrec"


@dataclass(frozen=True)
class EvalReport:
    source: str
    split: str
    n: int
    catalog_items: int
    systems: dict[str, Metrics]

    def as_dict(self) -> dict[str, Any]:
        first = next(iter(self.systems.values()))
        return {
            "source": self.source, "split": self.split, "cases": first.cases, "n": self.n,
            "catalog_items": self.catalog_items,
            "systems": {name: m.as_dict() for name, m in self.systems.items()},
        }  # fmt: skip

    def table(self) -> str:
        """One row per metric, one column per system."""
        names = list(self.systems)
        rows = [f"{'metric':<18}" + "".join(f"{n:>14}" for n in names)]
        metrics = {n: m.as_dict() for n, m in self.systems.items()}
        for key in metrics[names[0]]:
            if key == "cases":
                continue
            rows.append(f"{key:<18}" + "".join(f"{metrics[n][key]:>14.4f}" for n in names))
        return "\n".join(rows)


def engine_answers(
    engine: Any, cases: Sequence[HeldOut], max_history: int, n: int, batch: int, progress: bool
) -> list[list[Answer]]:
    """Ranked answers of the engine for each case (None marks a SID outside the catalog)."""
    from tqdm import tqdm

    catalog = engine.catalog
    answers: list[list[Answer]] = []
    with tqdm(total=len(cases), desc="eval", unit="user", disable=not progress) as bar:
        for start in range(0, len(cases), batch):
            chunk = cases[start : start + batch]
            requests = [
                engine.make_request(prompt=history_prompt(c.history, max_history), n=n)
                for c in chunk
            ]
            for result in engine.generate(requests):
                answers.append(
                    [c.items if catalog.row_of(c.codes) >= 0 else None for c in result.choices]
                )
            bar.update(len(chunk))
    return answers


def run_eval(
    engine: Any,
    split: Split,
    which: str,
    *,
    source: str,
    max_history: int,
    n: int = max(KS),
    batch: int = 256,
    progress: bool = True,
    max_cases: int | None = None,
) -> EvalReport:
    """Engine, popularity and co-occurrence on the `which` cases of `split`."""
    if engine.catalog is None:
        raise ValueError("flashrec eval needs a catalog: pass --catalog FILE")
    if n < max(KS):
        raise ValueError(f"-n {n} is below the largest cutoff {max(KS)}; pass -n {max(KS)} or more")
    cases = split.cases(which)[:max_cases]  # type: ignore[arg-type]
    if not cases:
        raise ValueError(f"the {which} split is empty: no user has 3 or more interactions")
    relevant = [{c.target} for c in cases]
    size = engine.catalog.num_items
    systems = {ENGINE: evaluate(engine_answers(engine, cases, max_history, n, batch, progress),
                                relevant, size)}  # fmt: skip
    for baseline in (PopularityBaseline(split.train), CooccurrenceBaseline(split.train)):
        answers = [baseline.recommend(c.history, n) for c in cases]
        systems[baseline.name] = evaluate(answers, relevant, size)
    return EvalReport(source, which, n, size, systems)
