"""rms_norm_quant_fp8: the reference against fp64 math, the Triton kernel against the ref."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import rms_norm_quant_fp8, rms_norm_quant_fp8_ref
from flashrec_kernels.testing import assert_fp8_close, assert_ulp_close

EPS = 1e-6
# The kernel sums h^2 in another order than torch: a tree/pairwise sum of N <= 256 positive terms
# is off by at most log2(N) <= 8 fp32 ulps, halved by the sqrt, plus the roundings of h * inv * w
# and absmax / 448: <= 6 ulps of the scale (1-3 seen). Codes are x / scale rounded to 3 mantissa
# bits, so a few fp32 ulps flip one only within that distance of a rounding boundary (odds ~2^-18
# per element), and then by exactly one code.
SCALE_ULP = 6
CODE_TOL = {"max_ulp": 1, "max_frac": 0.01}


def _inputs(t: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, generator=gen) * 4).to(dtype)
    residual = (torch.randn(t, n, generator=gen) * 4).to(dtype)
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [False, True])
def test_ref_matches_float64_formula(with_residual: bool) -> None:
    x, residual, weight = _inputs(6, 128, torch.bfloat16)
    q, scale, res_out = rms_norm_quant_fp8_ref(x, weight, EPS, residual if with_residual else None)
    if with_residual:
        # Independent: torch's own bf16 add rounds the fp32 sum once, as the ref must.
        assert torch.equal(res_out, x + residual)
        h = (x + residual).double()
    else:
        assert res_out is None
        h = x.double()
    out64 = h / torch.sqrt(h.square().mean(-1, keepdim=True) + EPS) * weight.double()
    scale64 = out64.abs().amax(-1, keepdim=True) / 448
    torch.testing.assert_close(scale.double(), scale64, rtol=2**-22, atol=0)  # ~2 fp32 ulps
    # Half an e4m3 step (2^-4 relative, 2^-10 * scale subnormal) plus fp32 noise in the ref.
    err = (q.double() * scale.double() - out64).abs()
    assert bool((err <= out64.abs() * (2.0**-4 + 1e-6) + scale64 * 2.0**-10).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_ref(device: torch.device, dtype: torch.dtype, with_residual: bool) -> None:
    x, residual, weight = (t.to(device) for t in _inputs(7, 96, dtype, seed=1))
    residual = residual if with_residual else None
    q, scale, res_out = rms_norm_quant_fp8(x, weight, EPS, residual)
    q_ref, scale_ref, res_ref = rms_norm_quant_fp8_ref(x, weight, EPS, residual)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)
    if with_residual:
        # Exact: one fp32 add rounded once to x.dtype on both sides.
        assert res_out.dtype == x.dtype and res_out.data_ptr() not in (x.data_ptr(), 0)
        assert_ulp_close(res_out, res_ref, max_ulp=0)
    else:
        assert res_out is None


def test_kernel_fp32_codes_are_exact(device: torch.device) -> None:
    """With fp32 inputs the only drift is the reduction order; the codes themselves agree."""
    x, residual, weight = (t.to(device) for t in _inputs(7, 128, torch.float32, seed=2))
    q, scale, _ = rms_norm_quant_fp8(x, weight, EPS, residual)
    q_ref, scale_ref, _ = rms_norm_quant_fp8_ref(x, weight, EPS, residual)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, max_ulp=0)


def test_kernel_strided_rows(device: torch.device) -> None:
    x, residual, weight = (t.to(device) for t in _inputs(5, 256, torch.bfloat16, seed=3))
    x_view, res_view, w = x[:, :128], residual[:, 128:], weight[:128]
    q, scale, res_out = rms_norm_quant_fp8(x_view, w, EPS, res_view)
    q_ref, scale_ref, res_ref = rms_norm_quant_fp8_ref(x_view.contiguous(), w, EPS, res_view)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)
    assert_ulp_close(res_out, res_ref, max_ulp=0)


def test_kernel_empty_batch(device: torch.device) -> None:
    x = torch.empty(0, 64, device=device)
    q, scale, res_out = rms_norm_quant_fp8(x, torch.ones(64, device=device), EPS, x)
    assert q.shape == (0, 64) and scale.shape == (0, 1) and res_out.shape == (0, 64)


def test_rejects_mismatched_shapes() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_quant_fp8_ref(x, torch.ones(4), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm_quant_fp8_ref(x, torch.ones(8), EPS, torch.zeros(3, 8))
