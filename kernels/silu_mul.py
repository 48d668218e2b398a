"""Fused SiLU(gate) * up -> per-token FP8: the MLP's down-projection input in one pass.

gate_up is the output of the fused gate_up GEMM: [T, 2I] with gate = columns [0, I) and
up = columns [I, 2I). Math, in fp32: out = gate / (1 + exp(-gate)) * up, then per-token FP8.
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import check_rows, quantize_rows_ref

__all__ = ["silu_mul_quant_fp8", "silu_mul_quant_fp8_ref"]

_KERNEL = "silu_mul_quant_fp8"


def _check_args(gate_up: torch.Tensor) -> None:
    check_rows(gate_up, "gate_up", _KERNEL, max_len=None)  # the kernel walks rows in chunks
    if gate_up.shape[1] % 2 != 0:
        raise ValueError(f"{_KERNEL}: gate_up needs an even width [T, 2I], got {gate_up.shape[1]}")


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
