"""Phi (1, 1.5, 2) for FlashRec. Exports the ModelSpec as `spec`; importing it needs no torch."""

from flashrec_models_phi.spec import PhiConfig, spec

__all__ = ["PhiConfig", "spec"]
