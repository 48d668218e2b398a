"""Kernel tests run the Triton kernels on CUDA when present, else in the Triton interpreter
(TRITON_INTERPRET is set by tests/conftest.py, before any module that may import triton)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets it"


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA if present, else CPU for the interpreter."""
    pytest.importorskip("triton")
    return torch.device("cuda" if ON_GPU else "cpu")
