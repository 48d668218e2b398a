"""Attention backends behind one protocol; GPU backends import their libraries lazily."""

from __future__ import annotations

import torch

from flashrec_core.attention.base import AttentionBackend
from flashrec_core.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata

BACKENDS = ("torch", "flashinfer")


def create_attention_backend(name: str, device: torch.device, **kwargs: object) -> AttentionBackend:
    """Build the named backend ("auto" = flashinfer on CUDA when importable, else torch)."""
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and _flashinfer_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend(device, **kwargs)
    if name == "flashinfer":
        from flashrec_core.attention.flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, **kwargs)
    raise ValueError(
        f"unknown attention backend '{name}'; choose one of auto, {', '.join(BACKENDS)}"
    )


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "AttentionBackend",
    "TorchAttentionBackend",
    "TorchAttentionMetadata",
    "create_attention_backend",
]
