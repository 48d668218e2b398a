"""Kernel tests run the Triton kernels on CUDA when present, else in the Triton interpreter
(TRITON_INTERPRET is set by tests/conftest.py, before any module that may import triton)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets it"


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA if present, else CPU for the interpreter."""
    pytest.importorskip("triton")
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def fp8_exact_queries() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """For the attention kernels' FP8 score dots (`fp8_scores`): q -> (q', rounded), q' being
    q with every (row, q head) row's largest element set to 7, so its scale (amax / 448) is
    2^-6, and rounded q' as the kernel rounds it (e4m3 codes times 2^-6): exact in bf16, the
    references' query type."""

    def make(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = q.float().clamp(-6.9, 6.9)
        q[..., 0] = 7.0
        q = q.bfloat16()
        return q, ((q.float() * 64.0).to(torch.float8_e4m3fn).float() / 64.0).bfloat16()

    return make
