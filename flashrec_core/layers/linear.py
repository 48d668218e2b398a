"""Linear projection with a BF16 path and an FP8 W8A8 path (per-channel weight scales)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.quant import (
    FP8_DTYPE,
    QuantizedActivation,
    fp8_linear,
    quantize_per_token,
)
from flashrec_kernels import fp8_gemm_rows


class Linear(nn.Module):
    """y = x W^T + b, where W may be the concatenation of several checkpoint projections.

    `output_sizes` records the fused partition (q, k, v or gate, up): the loader places checkpoint
    shard i at row offset sum(output_sizes[:i]). With FP8 on, `weight` is e4m3 [out, in] and
    `weight_scale` [out] float32; the input may arrive pre-quantized from a fused producer.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int] | int,
        *,
        bias: bool,
        ctx: BuildContext,
        fp8: bool | None = None,
    ) -> None:
        super().__init__()
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        self.output_sizes = sizes
        self.in_features = in_features
        self.out_features = sum(sizes)
        self.out_dtype = ctx.dtype
        self.fp8 = ctx.fp8_linear if fp8 is None else fp8
        self.triton_quant = ctx.triton
        rows = ctx.small_gemm_rows
        if rows is None:  # as far as this GPU's launch table measured the kernel faster
            rows = fp8_gemm_rows(self.out_features, in_features, ctx.device) if self.fp8 else 0
        self.small_gemm_rows = rows
        shape = (self.out_features, in_features)
        w_dtype = FP8_DTYPE if self.fp8 else ctx.dtype
        self.weight = nn.Parameter(torch.empty(shape, dtype=w_dtype, device=ctx.device), False)
        self.weight_scale = (
            nn.Parameter(
                torch.empty(self.out_features, dtype=torch.float32, device=ctx.device), False
            )
            if self.fp8
            else None
        )
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=ctx.dtype, device=ctx.device), False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if not self.fp8:
            assert isinstance(x, torch.Tensor), "a BF16 Linear takes an unquantized input"
            return nn.functional.linear(x, self.weight, self.bias)
        xq = x if isinstance(x, QuantizedActivation) else quantize_per_token(x, self.triton_quant)
        assert self.weight_scale is not None, "FP8 Linear always has a weight scale"
        return fp8_linear(
            xq, self.weight, self.weight_scale, self.bias, self.out_dtype, self.small_gemm_rows
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, fp8={self.fp8}"
