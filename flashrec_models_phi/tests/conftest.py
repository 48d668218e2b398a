"""Kernel tests run the Triton kernels on CUDA when present, else in the Triton interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test
module imports triton. NOTE: process wide; harmless for the conformance suite, whose engine runs
Triton on CPU only with `triton_on_cpu`. On CUDA it stays unset, or kernels would run interpreted.
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
