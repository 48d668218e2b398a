"""Non-gated GELU (tanh approximation) with an FP8-quantizing variant for the following GEMM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashrec_core.layers.quant import QuantizedActivation, quantize_per_token


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): HF's "gelu_new" / "gelu_pytorch_tanh"."""
    return nn.functional.gelu(x, approximate="tanh")


class GeluTanh(nn.Module):
    """GELU(tanh) of an MLP's up projection; a `QuantizedActivation` when the next GEMM is FP8.

    The fused kernel, when given, is called as `kernel(x)` and returns
    (e4m3 codes [T, I], fp32 scale [T, 1]); else the eager path quantizes.
    """

    def __init__(
        self, *, quantize_output: bool = False, fused_kernel: Callable[..., Any] | None = None
    ) -> None:
        super().__init__()
        self.quantize_output = quantize_output
        self.fused_kernel = fused_kernel if quantize_output else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if self.fused_kernel is not None:
            return QuantizedActivation(*self.fused_kernel(x))
        if not self.quantize_output:
            return gelu_tanh(x)
        return quantize_per_token(gelu_tanh(x.float()))  # fp32, like the fused kernel
