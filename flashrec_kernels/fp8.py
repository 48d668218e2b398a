"""The per-token FP8 activation format and its plain quantizer (torch reference + Triton wrapper).

Format (shared by every fused norm/activation kernel, so a GEMM can consume any of them):
e4m3fn codes [T, N] and one float32 scale per row [T, 1], scale = max(absmax(row), 1e-12) / 448,
code = clamp(row / scale, -448, 448) rounded to nearest even. Dequantized value = code * scale.
"""

from __future__ import annotations

import torch

from .device import check_triton_device

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_ABSMAX",
    "check_rows",
    "per_token_quant_fp8",
    "per_token_quant_fp8_ref",
    "quantize_rows_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_ABSMAX = 1e-12  # keeps an all-zero row's scale finite (its codes are then all 0)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROW_LEN = 32768  # kernels holding a whole row in registers; wider rows would spill


def quantize_rows_ref(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [T, N] -> (e4m3 codes [T, N], fp32 scale [T, 1]); the quantizer every ref shares."""
    h = h.float()
    absmax = h.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_ABSMAX)
    # A tensor divisor on purpose: CUDA torch turns `t / python_scalar` into t * (1 / scalar),
    # which is an ulp off the IEEE quotient the kernels (and CPU torch) compute.
    scale = absmax / torch.full_like(absmax, FP8_MAX)
    # The clamp matters: x / scale can exceed 448 by an ulp, and e4m3fn has no inf (it would be NaN).
    q = (h / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def check_rows(x: torch.Tensor, name: str, kernel: str, max_len: int | None = MAX_ROW_LEN) -> None:
    """Raise if `x` is not a [T, N] float activation with unit stride along N (N <= max_len)."""
    if x.dim() != 2:
        raise ValueError(f"{kernel}: {name} must be 2-D [T, N], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{kernel}: {name} must be float32/bfloat16/float16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(
            f"{kernel}: {name} needs unit stride along its last dim, got strides {x.stride()}; "
            "pass a row-strided view or call .contiguous()"
        )
    if max_len is not None and x.shape[1] > max_len:
        raise ValueError(f"{kernel}: rows of {x.shape[1]} exceed the supported {max_len}")


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (e4m3 [T, N], fp32 scale [T, 1]), computed in fp32."""
    check_rows(x, "x", "per_token_quant_fp8")
    return quantize_rows_ref(x.float())


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `per_token_quant_fp8_ref`; rows may be strided (unit stride along N)."""
    check_rows(x, "x", "per_token_quant_fp8")
    check_triton_device(x, "per_token_quant_fp8")
    from .triton_quant import launch_per_token_quant_fp8

    return launch_per_token_quant_fp8(x)
