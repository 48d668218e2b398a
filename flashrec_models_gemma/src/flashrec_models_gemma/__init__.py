"""Gemma and Gemma 2 for FlashRec. Exports one ModelSpec per architecture."""

from flashrec_models_gemma.spec import GemmaConfig, gemma2_spec, gemma_spec

__all__ = ["GemmaConfig", "gemma2_spec", "gemma_spec"]
