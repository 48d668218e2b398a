"""Model building, the model runner and the offline generation engine."""

from flashrec_core.engine.build import (
    FusedDecision,
    LoadedModel,
    create_build_context,
    create_kv_pool,
    load_model,
    resolve_fused_paths,
)
from flashrec_core.engine.model_runner import ModelRunner, StepInput, prepare_prefill

__all__ = [
    "FusedDecision",
    "LoadedModel",
    "ModelRunner",
    "StepInput",
    "create_build_context",
    "create_kv_pool",
    "load_model",
    "prepare_prefill",
    "resolve_fused_paths",
]
