"""Qwen3 for FlashRec: the reference model plugin. Exports the ModelSpec as `spec`."""

from flashrec_models_qwen3.spec import Qwen3Config, spec

__all__ = ["Qwen3Config", "spec"]
