"""Llama and Qwen2 for FlashRec: one Llama-structure decoder, one ModelSpec per architecture."""

from flashrec_models_llama.spec import LlamaConfig, llama_spec, qwen2_spec

__all__ = ["LlamaConfig", "llama_spec", "qwen2_spec"]
