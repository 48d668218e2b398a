"""LayerNorm (mean and variance, optional bias) with the fused residual add and an FP8 output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.quant import QuantizedActivation, quantize_per_token


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Normalize the last dim (torch accumulates in fp32 for half inputs), in x's dtype."""
    return nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNorm(nn.Module):
    """`norm(x, residual)` -> (y, x + residual): the two-stream residual (residual None: (y, x)).

    With `quantize_output` (the consumer is an FP8 GEMM) y is a `QuantizedActivation`. The fused
    kernel, when given, is called as `kernel(x, weight, bias, eps, residual)` and returns
    (e4m3 codes [T, H], fp32 scale [T, 1], x + residual or None); else the eager path quantizes.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        ctx: BuildContext,
        *,
        bias: bool = True,
        quantize_output: bool = False,
        fused_kernel: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=ctx.dtype, device=ctx.device), False
        )
        self.bias = (
            nn.Parameter(torch.empty(hidden_size, dtype=ctx.dtype, device=ctx.device), False)
            if bias
            else None
        )
        self.identity_weight = 1.0  # the stored weight of a norm that only normalizes
        self.quantize_output = quantize_output
        self.fused_kernel = fused_kernel if quantize_output else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        if self.fused_kernel is not None:
            data, scale, new_residual = self.fused_kernel(
                x, self.weight, self.bias, self.eps, residual
            )
            return QuantizedActivation(data, scale), x if new_residual is None else new_residual
        if residual is not None:
            x = x + residual
        if not self.quantize_output:
            return layer_norm(x, self.weight, self.bias, self.eps), x
        # Quantize the fp32 output, like the fused kernel: no detour through x's dtype.
        bias = None if self.bias is None else self.bias.float()
        return quantize_per_token(layer_norm(x.float(), self.weight.float(), bias, self.eps)), x
