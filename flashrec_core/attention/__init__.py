"""Attention backends behind one protocol; GPU backends import their libraries lazily."""

from __future__ import annotations

import torch

from flashrec_core.attention.base import (
    AttentionBackend,
    LayerGroups,
    graph_index_buffers,
    window_shared_prefix,
)
from flashrec_core.attention.step import SharedPrefix, StepInput, flatten_shared_prefix
from flashrec_core.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata

BACKENDS = ("torch", "flashinfer")


def create_attention_backend(name: str, device: torch.device, **kwargs: object) -> AttentionBackend:
    """Build the named backend (already resolved: `config.resolve_engine_config` turns "auto"
    into one of BACKENDS)."""
    if name == "torch":
        return TorchAttentionBackend(device, **kwargs)
    if name == "flashinfer":
        from flashrec_core.attention.flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, **kwargs)
    raise ValueError(f"unknown attention backend '{name}'; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "AttentionBackend",
    "LayerGroups",
    "SharedPrefix",
    "StepInput",
    "flatten_shared_prefix",
    "graph_index_buffers",
    "window_shared_prefix",
    "TorchAttentionBackend",
    "TorchAttentionMetadata",
    "create_attention_backend",
]
