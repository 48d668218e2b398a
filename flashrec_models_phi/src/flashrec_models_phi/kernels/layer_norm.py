"""Fused (residual add +) LayerNorm -> per-token FP8: the one input of Phi's qkv and fc1 GEMMs.

Math, in fp32 (torch reference and Triton kernel alike):
    h            = x + residual, rounded to x.dtype   (returned as residual_out)   if residual given
    h            = x                                                            otherwise
    d            = h - sum(h) / N
    out          = d * (1 / sqrt(sum(d^2) / N + eps)) * weight (+ bias)
    (q, scale)   = per-token FP8 of out
The variance is taken over the centered row (two passes over registers), as torch does. The norm
reads the residual as stored (rounded to x.dtype), so the fused path equals the unfused
"add in x.dtype, then norm" path that layers run when the fused switch is off.
"""

from __future__ import annotations

import torch

from flashrec_kernels import quantize_rows_ref
from flashrec_kernels.device import check_triton_device
from flashrec_kernels.fp8 import check_rows

__all__ = ["layer_norm_quant_fp8", "layer_norm_quant_fp8_ref"]

_KERNEL = "layer_norm_quant_fp8"


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    check_rows(x, "x", _KERNEL)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (x.shape[1],):
            raise ValueError(f"{_KERNEL}: {name} must be [{x.shape[1]}], got {tuple(p.shape)}")
    if residual is not None:
        check_rows(residual, "residual", _KERNEL)
        if residual.shape != x.shape:
            raise ValueError(
                f"{_KERNEL}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )


def layer_norm_quant_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, N], weight/bias [N] -> (e4m3 [T, N], fp32 scale [T, 1], residual_out [T, N] or None)."""
    _check_args(x, weight, bias, residual)
    h = x.float()
    residual_out = None
    if residual is not None:
        residual_out = (h + residual.float()).to(x.dtype)
        h = residual_out.float()
    d = h - h.mean(dim=-1, keepdim=True)
    inv_std = 1.0 / torch.sqrt(d.square().mean(dim=-1, keepdim=True) + eps)
    out = d * inv_std * weight.float()
    if bias is not None:
        out = out + bias.float()
    q, scale = quantize_rows_ref(out)
    return q, scale, residual_out


def layer_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of `layer_norm_quant_fp8_ref`; residual_out is a new contiguous tensor."""
    _check_args(x, weight, bias, residual)
    check_triton_device(x, _KERNEL)
    from .triton_layer_norm import launch_layer_norm_quant_fp8

    return launch_layer_norm_quant_fp8(x, weight, bias, eps, residual)
