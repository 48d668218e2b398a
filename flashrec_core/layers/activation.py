"""Gated activations (SwiGLU: SiLU(gate) * up; GeGLU: GELU-tanh(gate) * up) with FP8-quantizing
variants for the following GEMM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashrec_core.layers.quant import QuantizedActivation
from flashrec_kernels import gelu_tanh_mul_quant_fp8_ref, silu_mul_quant_fp8_ref


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: SiLU(gate) * up with gate the first half (the gate_up bucket order)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: GELU-tanh(gate) * up (HF `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


class _GatedActivation(nn.Module):
    """act(gate) * up; a `QuantizedActivation` when the next GEMM is FP8, through the fused
    kernel when given, else that kernel's torch reference (no intermediate bf16 rounding)."""

    eager: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def __init__(
        self, *, quantize_output: bool = False, fused_kernel: Callable[..., Any] | None = None
    ) -> None:
        super().__init__()
        self.quantize_output = quantize_output
        self.fused_kernel = fused_kernel if quantize_output else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if self.quantize_output:
            kernel = self.fused_kernel or type(self).reference
            return QuantizedActivation(*kernel(gate_up))
        return type(self).eager(gate_up)


class SiluAndMul(_GatedActivation):
    """SiLU(gate) * up (SwiGLU)."""

    eager = staticmethod(silu_and_mul)
    reference = staticmethod(silu_mul_quant_fp8_ref)


class GeluAndMul(_GatedActivation):
    """GELU-tanh(gate) * up (GeGLU; the shared `gelu_tanh_mul_quant_fp8` kernel when FP8)."""

    eager = staticmethod(gelu_tanh_and_mul)
    reference = staticmethod(gelu_tanh_mul_quant_fp8_ref)
