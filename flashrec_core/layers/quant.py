"""FP8 (e4m3) W8A8 helpers: per-token activation quantization and the scaled GEMM."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashrec_kernels import FP8_DTYPE as FP8_DTYPE  # re-exported by flashrec_core.layers
from flashrec_kernels import FP8_MAX as FP8_MAX
from flashrec_kernels import (
    fp8_gemm,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
    quantize_rows_ref,
)


class QuantizedActivation(NamedTuple):
    """An FP8 activation with its per-token scale, produced by a fused norm or activation."""

    data: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32


def quantize_per_token(x: torch.Tensor, triton: bool = False) -> QuantizedActivation:
    """Per-token absmax quantization, for inputs no fused producer quantized: one Triton kernel
    when `triton` (decided at build time), else the torch reference (same codes and scales)."""
    data, scale = per_token_quant_fp8(x) if triton else per_token_quant_fp8_ref(x)
    return QuantizedActivation(data, scale)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel absmax quantization of a [out, in] weight (BF16 checkpoint -> FP8):
    the activations' per-row quantizer applied to weight rows. Returns (codes, scale [out])."""
    q, scale = quantize_rows_ref(w)
    return q, scale.squeeze(1)


def fp8_linear(
    x: QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    triton_rows: int = 0,
) -> torch.Tensor:
    """y = (x_q * s_x) @ (w_q * s_w).T + b: the Triton small-row GEMM for at most `triton_rows`
    rows (decided at build time where Triton runs, BuildContext.small_gemm_rows), else
    `torch._scaled_mm` on CUDA, exact dequant elsewhere."""
    if x.data.shape[0] <= triton_rows:
        return fp8_gemm(x.data, x.scale.reshape(-1), weight, weight_scale, bias, out_dtype)
    if weight.is_cuda and out_dtype in (torch.bfloat16, torch.float16):
        # NOTE: _scaled_mm wants a column-major second operand: weight.t() of a row-major weight.
        return torch._scaled_mm(
            x.data,
            weight.t(),
            scale_a=x.scale,
            scale_b=weight_scale.view(1, -1),
            bias=bias,
            out_dtype=out_dtype,
        )
    y = (x.data.float() * x.scale) @ (weight.float() * weight_scale.view(-1, 1)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
