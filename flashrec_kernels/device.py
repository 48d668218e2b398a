"""Where the Triton kernels can run, decided without importing triton.

The engine asks `triton_available` once at build time (switch AND capability AND kernel available);
the public kernel wrappers call `check_triton_device` so a misrouted CPU tensor fails with a message
instead of Triton's "0 active drivers".
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["check_triton_device", "triton_available", "triton_interpreting"]

_TRUE_VALUES = frozenset({"1", "true", "on", "yes"})


def triton_interpreting() -> bool:
    """Whether TRITON_INTERPRET asks Triton to run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_VALUES


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can launch on `device` (CUDA, or CPU under the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return dev.type == "cpu" and triton_interpreting()


def check_triton_device(t: torch.Tensor, kernel: str) -> None:
    """Raise a clear error when `kernel` is asked to launch where Triton cannot run."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting()):
        return
    raise RuntimeError(
        f"{kernel} is a Triton kernel and got a tensor on {t.device}; it runs on CUDA, or on CPU "
        f"with TRITON_INTERPRET=1. Use {kernel}_ref for the pure-torch path."
    )
