"""Fused GELU (tanh approximation) -> per-token FP8: the input of Phi's fc2 GEMM in one pass.

x is the fc1 output [T, I]. Math, in fp32 (torch reference and Triton kernel alike):
    u            = sqrt(2 / pi) * (x + 0.044715 * x^3)
    out          = x / (1 + exp(-2 u))
    (q, scale)   = per-token FP8 of out
Since (1 + tanh(u)) / 2 = 1 / (1 + exp(-2 u)), out is 0.5 x (1 + tanh(u)), HF's "gelu_new",
written without tanh (Triton has none portable to the interpreter) and without overflow to NaN:
exp(-2 u) = inf for very negative x gives x / inf = -0, the limit of GELU.
"""

from __future__ import annotations

import math

import torch

from flashrec_kernels import quantize_rows_ref
from flashrec_kernels.device import check_triton_device
from flashrec_kernels.fp8 import check_rows

__all__ = ["gelu_tanh_quant_fp8", "gelu_tanh_quant_fp8_ref"]

_KERNEL = "gelu_tanh_quant_fp8"
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def gelu_tanh_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, I] -> (e4m3 [T, I], fp32 scale [T, 1])."""
    check_rows(x, "x", _KERNEL, max_len=None)  # the kernel walks rows in chunks
    x = x.float()
    # Written out rather than F.gelu so the kernel can spell the identical fp32 operations.
    u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
    return quantize_rows_ref(x / (1.0 + torch.exp(-2.0 * u)))


def gelu_tanh_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `gelu_tanh_quant_fp8_ref`; rows may be strided (unit stride along I)."""
    check_rows(x, "x", _KERNEL, max_len=None)
    check_triton_device(x, _KERNEL)
    from .triton_gelu import launch_gelu_tanh_quant_fp8

    return launch_gelu_tanh_quant_fp8(x)
