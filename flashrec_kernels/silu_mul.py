"""Fused gated activations -> per-token FP8: the MLP's down-projection input in one pass.

gate_up is the output of the fused gate_up GEMM: [T, 2I] with gate = columns [0, I) and
up = columns [I, 2I). Math, in fp32, then per-token FP8:
- SwiGLU (`silu_mul_quant_fp8`): out = gate / (1 + exp(-gate)) * up;
- GeGLU (`gelu_tanh_mul_quant_fp8`): out = gate / (1 + exp(-2u)) * up with
  u = sqrt(2/pi) (gate + 0.044715 gate^3), i.e. GELU(tanh)(gate) * up written without tanh.
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import check_rows, quantize_rows_ref

__all__ = [
    "gelu_tanh_mul_quant_fp8",
    "gelu_tanh_mul_quant_fp8_ref",
    "silu_mul_quant_fp8",
    "silu_mul_quant_fp8_ref",
]

_KERNEL = "silu_mul_quant_fp8"
SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


def _check_args(gate_up: torch.Tensor, kernel: str = _KERNEL) -> None:
    check_rows(gate_up, "gate_up", kernel, max_len=None)  # the kernel walks rows in chunks
    if gate_up.shape[1] % 2 != 0:
        raise ValueError(f"{kernel}: gate_up needs an even width [T, 2I], got {gate_up.shape[1]}")


def silu_mul_quant_fp8_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] -> (e4m3 [T, I], fp32 scale [T, 1])."""
    _check_args(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    # Written out rather than F.silu so the kernel can spell the identical fp32 operations.
    return quantize_rows_ref(gate / (1.0 + torch.exp(-gate)) * up)


def silu_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `silu_mul_quant_fp8_ref`."""
    _check_args(gate_up)
    check_triton_device(gate_up, _KERNEL)
    from .triton_silu_mul import launch_silu_mul_quant_fp8

    return launch_silu_mul_quant_fp8(gate_up)


def gelu_tanh_mul_quant_fp8_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] -> (e4m3 [T, I], fp32 scale [T, 1]): GELU(tanh)(gate) * up."""
    _check_args(gate_up, "gelu_tanh_mul_quant_fp8")
    gate, up = gate_up.float().chunk(2, dim=-1)
    u = SQRT_2_OVER_PI * (gate + GELU_CUBIC * gate * gate * gate)
    return quantize_rows_ref(gate / (1.0 + torch.exp(-2.0 * u)) * up)


def gelu_tanh_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `gelu_tanh_mul_quant_fp8_ref` (the SwiGLU kernel with ACT=GELU)."""
    _check_args(gate_up, "gelu_tanh_mul_quant_fp8")
    check_triton_device(gate_up, "gelu_tanh_mul_quant_fp8")
    from .triton_silu_mul import ACT_GELU_TANH, launch_silu_mul_quant_fp8

    return launch_silu_mul_quant_fp8(gate_up, ACT_GELU_TANH)
