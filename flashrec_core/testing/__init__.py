"""Test helpers shipped with the core: tiny checkpoints, the HF oracle, the conformance suite.

Importing this package imports pytest and transformers: only tests and plugins' suites use it.
"""

from flashrec_core.testing.checkpoint import build_hf_model, build_tokenizer, write_tiny_checkpoint
from flashrec_core.testing.conformance import ModelConformance

__all__ = ["ModelConformance", "build_hf_model", "build_tokenizer", "write_tiny_checkpoint"]
