"""Kernel tests run the Triton kernels on CUDA when present, else in the Triton interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, and test modules decorate their own helper
kernels at import, so it is set here, before any test module is collected. NOTE: this is process
wide; a run that collects tests/kernels sees the interpreter everywhere. On CUDA it stays unset,
or the kernels would run interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA if present, else CPU for the interpreter."""
    pytest.importorskip("triton")
    return torch.device("cuda" if ON_GPU else "cpu")
