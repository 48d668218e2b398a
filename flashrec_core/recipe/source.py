"""Where a recipe's interactions come from: a log file, or the built-in synthetic log. Recorded
in recipe.json so that `flashrec eval` rebuilds exactly the split the model was trained on."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from flashrec_core.recipe.interactions import InteractionLog, LogFormat, load_log
from flashrec_core.recipe.synthetic import SyntheticConfig, synthetic_log


class SyntheticSource(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["synthetic"] = "synthetic"
    users: int = Field(default=2000, gt=0)
    seed: int = 0


Source = Annotated[LogFormat | SyntheticSource, Field(discriminator="kind")]


def load_source(source: LogFormat | SyntheticSource) -> InteractionLog:
    if isinstance(source, SyntheticSource):
        log, _ = synthetic_log(SyntheticConfig(users=source.users, seed=source.seed))
        return log
    return load_log(source)


def describe(source: LogFormat | SyntheticSource) -> str:
    if isinstance(source, SyntheticSource):
        return f"synthetic food-ordering log ({source.users} users, seed {source.seed})"
    return source.path
