"""per_token_quant_fp8: the reference against first principles, the Triton kernel against the ref."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import (
    FP8_DTYPE,
    MIN_ABSMAX,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
)
from flashrec_kernels.testing import assert_fp8_close, ulp_distance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(t: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows whose magnitudes span several binades, so normal and subnormal codes both occur."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-6, 6, (t, 1), generator=gen).float())
    return (torch.randn(t, n, generator=gen) ** 3 * row_scale).to(dtype)


def test_ref_hand_example() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = per_token_quant_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (2, 1)
    # Row 0: absmax 2 maps to 448, so codes are x * 224 and all exactly representable.
    assert torch.equal(q[0].float(), torch.tensor([224.0, -448.0, 112.0, 0.0]))
    assert scale[0, 0] == torch.tensor(2.0 / 448, dtype=torch.float32)
    # Row 1: an all-zero row keeps a finite scale and zero codes instead of NaN.
    assert scale[1, 0] == torch.tensor(MIN_ABSMAX / 448, dtype=torch.float32)
    assert torch.equal(q[1].float(), torch.zeros(4))


def test_ref_matches_float64_quantization() -> None:
    """Independent formula: fp64 scale and one rounding of x / scale straight to e4m3."""
    x = _rows(16, 128, torch.float32)
    q, scale = per_token_quant_fp8_ref(x)
    x64 = x.double()
    scale64 = x64.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(scale, scale64.float())
    expected = (x64 / scale64).clamp(-448, 448).to(FP8_DTYPE)
    # fp32 vs fp64 division differ by < 1 fp32 ulp, which moves a code only at an exact tie.
    assert int(ulp_distance(q, expected).max()) <= 1
    # Quantization error is at most half an e4m3 step: 2^-4 relative, 2^-10 * scale if subnormal.
    err = (q.double() * scale64 - x64).abs()
    assert bool((err <= x64.abs() * 2.0**-4 + scale64 * 2.0**-10 + 1e-12).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    x = _rows(7, 96, dtype).to(device)
    q, scale = per_token_quant_fp8(x)
    q_ref, scale_ref = per_token_quant_fp8_ref(x)
    # Exact: absmax is order-independent, and the kernel divides with IEEE div_rn like torch.
    assert_fp8_close(q, scale, q_ref, scale_ref, max_ulp=0)


def test_kernel_strided_rows_and_zero_row(device: torch.device) -> None:
    base = _rows(5, 256, torch.bfloat16, seed=3).to(device)
    base[2] = 0
    x = base[:, 64:192]  # row stride 256, unit stride along N
    q, scale = per_token_quant_fp8(x)
    q_ref, scale_ref = per_token_quant_fp8_ref(x.contiguous())
    assert_fp8_close(q, scale, q_ref, scale_ref, max_ulp=0)


def test_kernel_empty_batch(device: torch.device) -> None:
    q, scale = per_token_quant_fp8(torch.empty(0, 64, device=device))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D"):
        per_token_quant_fp8_ref(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="unit stride"):
        per_token_quant_fp8_ref(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        per_token_quant_fp8_ref(torch.zeros(2, 4, dtype=torch.int32))
