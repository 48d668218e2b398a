"""From an interaction log to a servable GenRec checkpoint (`flashrec recipe build`).

Importing the package stays light (no torch): training is imported when a build runs."""

from flashrec_core.recipe.build import (
    CATALOG_FILE,
    RECIPE_FILE,
    BuildReport,
    build_recipe,
    read_recipe,
)
from flashrec_core.recipe.config import ModelShape, RecipeConfig, TrainConfig
from flashrec_core.recipe.interactions import InteractionLog, InteractionsError, LogFormat, load_log
from flashrec_core.recipe.source import SyntheticSource, load_source
from flashrec_core.recipe.split import HeldOut, Split, leave_last_out
from flashrec_core.recipe.synthetic import SyntheticConfig, synthetic_log
from flashrec_core.recipe.tokenizer import history_prompt

__all__ = [
    "CATALOG_FILE",
    "RECIPE_FILE",
    "BuildReport",
    "HeldOut",
    "InteractionLog",
    "InteractionsError",
    "LogFormat",
    "ModelShape",
    "RecipeConfig",
    "Split",
    "SyntheticConfig",
    "SyntheticSource",
    "TrainConfig",
    "build_recipe",
    "history_prompt",
    "leave_last_out",
    "load_log",
    "load_source",
    "read_recipe",
    "synthetic_log",
]
