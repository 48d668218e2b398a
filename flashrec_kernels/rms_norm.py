"""Fused (residual add +) RMSNorm -> per-token FP8: the input of the next FP8 GEMM in one pass.

Math, in fp32 (torch reference and Triton kernel alike):
    h            = x + residual, rounded to x.dtype   (returned as residual_out)   if residual given
    h            = x                                                            otherwise
    out          = h * (1 / sqrt(mean(h^2) + eps)) * weight
    (q, scale)   = per-token FP8 of out
The norm reads the residual as stored (rounded to x.dtype), so the fused path equals the unfused
"add in x.dtype, then norm" path that layers run when the fused switch is off.
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import check_rows, quantize_rows_ref

__all__ = ["rms_norm_quant_fp8", "rms_norm_quant_fp8_ref"]

_KERNEL = "rms_norm_quant_fp8"


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_rows(x, "x", _KERNEL)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{_KERNEL}: weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None:
        check_rows(residual, "residual", _KERNEL)
        if residual.shape != x.shape:
            raise ValueError(
                f"{_KERNEL}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )


def rms_norm_quant_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, N], weight [N] -> (e4m3 [T, N], fp32 scale [T, 1], residual_out [T, N] or None)."""
    _check_args(x, weight, residual)
    h = x.float()
    residual_out = None
    if residual is not None:
        residual_out = (h + residual.float()).to(x.dtype)
        h = residual_out.float()
    inv_rms = 1.0 / torch.sqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    q, scale = quantize_rows_ref(h * inv_rms * weight.float())
    return q, scale, residual_out


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of `rms_norm_quant_fp8_ref`; residual_out is a new contiguous tensor."""
    _check_args(x, weight, residual)
    check_triton_device(x, _KERNEL)
    from .triton_rms_norm import launch_rms_norm_quant_fp8

    return launch_rms_norm_quant_fp8(x, weight, eps, residual)
