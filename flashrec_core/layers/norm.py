"""RMSNorm with the fused residual add, and its FP8-quantizing variant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.quant import QuantizedActivation
from flashrec_kernels import rms_norm_quant_fp8_ref


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """Normalize in fp32 and scale by the weight, the way HF checkpoints were trained.

    weight_offset 0: `weight * x.to(dtype)`; non-zero (1.0 for norms stored as `1 + weight`): the
    gain is `weight + offset`, applied in fp32 before the cast back, as such norms compute it.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight_offset:
        return (x32 * (weight.float() + weight_offset)).to(x.dtype)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """`norm(x, residual)` -> (y, x + residual): the two-stream residual (residual None: (y, x)).

    With `quantize_output` (the consumer is an FP8 GEMM) y is a `QuantizedActivation`; the fused
    kernel produces it in one pass when the `fused_kernel` is given, else the eager path quantizes.
    `weight_offset` (1.0 for norms stored as `1 + weight`) makes the gain `weight + offset`; `identity_weight` is then the
    stored weight of a norm that only normalizes (what the conformance suite draws around).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        ctx: BuildContext,
        *,
        quantize_output: bool = False,
        fused_kernel: Callable[..., Any] | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=ctx.dtype, device=ctx.device), False
        )
        self.weight_offset = weight_offset
        self.identity_weight = 1.0 - weight_offset
        self.quantize_output = quantize_output
        self.fused_kernel = fused_kernel if quantize_output else None

    def gain(self) -> torch.Tensor:
        """The multiplier after normalizing: the weight itself, or weight + offset in fp32 (one
        small op per call; folding it into the weight would break the strict-load check)."""
        return self.weight if not self.weight_offset else self.weight.float() + self.weight_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        if self.quantize_output:
            # The fallback is the fused kernel's torch reference: same math, same FP8 rounding
            # (normalized in fp32 and quantized without an intermediate bf16 rounding).
            kernel = self.fused_kernel or rms_norm_quant_fp8_ref
            data, scale, new_residual = kernel(x, self.gain(), self.eps, residual)
            return QuantizedActivation(data, scale), x if new_residual is None else new_residual
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps, self.weight_offset), x
