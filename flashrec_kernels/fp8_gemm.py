"""W8A8 FP8 GEMM for few rows: y = (a_q * s_a) @ (w_q * s_w)^T (+ bias), per-token activation
scales and per-output-channel weight scales (the format of `flashrec_kernels.fp8`).

Why a kernel of our own: a beam step of one to a few requests multiplies 50-500 rows by every
weight of the model, so it is bound by reading the weights. `torch._scaled_mm` with row-wise
scales reaches ~20% of an H100's memory bandwidth there (scripts/bench_gemm.py, 50 rows: 67 us
a layer against ~15 us to read the layer's weights; docs/benchmarks.md, session 22): its tiles
leave most SMs idle when the rows fit one tile. The Triton kernel gives every SM a narrow slice
of the output columns over the whole K, so all of them stream weights at once; a launch with
`split_k` > 1 also cuts K into that many ranges, one program each, and sums their fp32
partials in a second kernel (fewer dependent K steps a program). Larger row counts
(prefills, full waves) stay on `torch._scaled_mm`, which is compute-efficient there.

Math, for both functions: acc = sum_k a_q[m, k] * w_q[n, k] in fp32 (products of two e4m3 codes
are exact in fp32), y = acc * s_a[m] * s_w[n] (+ bias[n]), rounded once to the output dtype. The
reference sums in a different order, so results agree to fp32 accumulation error plus one
rounding of the output (tests/kernels/test_fp8_gemm.py derives the bound).
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import FP8_DTYPE
from .fp8_gemm_tables import config_file, tuned_table

__all__ = ["fp8_gemm", "fp8_gemm_ref", "fp8_gemm_rows"]

_KERNEL = "fp8_gemm"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_args(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> None:  # fmt: skip
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(
            f"{_KERNEL}: a must be [M, K] and w [N, K] with the same K, got {tuple(a.shape)} and "
            f"{tuple(w.shape)}"
        )
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"{_KERNEL}: a and w must be {FP8_DTYPE}, got {a.dtype} and {w.dtype}")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{_KERNEL}: a and w need unit stride along K; call .contiguous()")
    m, n = a.shape[0], w.shape[0]
    if a_scale.dtype != torch.float32 or a_scale.numel() != m:
        raise ValueError(f"{_KERNEL}: a_scale must be float32 with one value per row ({m})")
    if w_scale.dtype != torch.float32 or w_scale.numel() != n:
        raise ValueError(f"{_KERNEL}: w_scale must be float32 with one value per output ({n})")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"{_KERNEL}: bias must hold one value per output ({n})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{_KERNEL}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def fp8_gemm_ref(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """a [M, K] e4m3, a_scale [M] or [M, 1], w [N, K] e4m3, w_scale [N] -> [M, N] out_dtype."""
    _check_args(a, a_scale, w, w_scale, bias, out_dtype)
    y = (a.float() @ w.float().t()) * a_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float().reshape(1, -1)
    return y.to(out_dtype)


def fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    **launch: int,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `fp8_gemm_ref`. `launch` overrides the launch configuration
    (block_m, block_n, block_k, num_warps, num_stages, split_k; scripts/bench_gemm.py sweeps
    them)."""
    _check_args(a, a_scale, w, w_scale, bias, out_dtype)
    check_triton_device(a, _KERNEL)
    from .triton_fp8_gemm import launch_fp8_gemm

    return launch_fp8_gemm(a, a_scale, w, w_scale, bias, out_dtype, **launch)


def fp8_gemm_rows(out_features: int, in_features: int, device: torch.device | str) -> int:
    """Up to how many rows `fp8_gemm` is faster than `torch._scaled_mm` for a weight
    [out_features, in_features] on `device`, as its GPU's launch table measured (`max_rows`,
    flashrec_kernels.fp8_gemm_tables); 0 off CUDA or without a table for this GPU and shape."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 0
    entry = tuned_table(config_file(torch.cuda.get_device_name(dev))).get(
        (out_features, in_features)
    )
    return entry.max_rows if entry is not None else 0
