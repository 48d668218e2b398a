"""Offline evaluation: top-k metrics, baselines, and `flashrec eval` through the engine."""

from flashrec_core.evaluation.baselines import CooccurrenceBaseline, PopularityBaseline
from flashrec_core.evaluation.metrics import KS, Answer, Metrics, evaluate, unique_ranking
from flashrec_core.evaluation.runner import ENGINE, EvalReport, engine_answers, run_eval

__all__ = [
    "ENGINE",
    "KS",
    "Answer",
    "CooccurrenceBaseline",
    "EvalReport",
    "Metrics",
    "PopularityBaseline",
    "engine_answers",
    "evaluate",
    "run_eval",
    "unique_ranking",
]
