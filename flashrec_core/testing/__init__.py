"""Test helpers shipped with the core: tiny checkpoints, the HF oracle, the conformance suite.

`ModelConformance` is imported lazily: it needs pytest, which only test environments have.
"""

from __future__ import annotations

from typing import Any

from flashrec_core.testing.checkpoint import build_hf_model, build_tokenizer, write_tiny_checkpoint

__all__ = ["ModelConformance", "build_hf_model", "build_tokenizer", "write_tiny_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "ModelConformance":
        from flashrec_core.testing.conformance import ModelConformance

        return ModelConformance
    raise AttributeError(f"module 'flashrec_core.testing' has no attribute {name!r}")
