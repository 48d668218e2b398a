"""Checkpoint reading and the strict, spec-driven weight loader."""

from flashrec_core.loader.checkpoint import Checkpoint, CheckpointError
from flashrec_core.loader.weights import LoadReport, WeightLoader, load_weights

__all__ = ["Checkpoint", "CheckpointError", "LoadReport", "WeightLoader", "load_weights"]
