"""Phi's kernels: references against independent torch formulas (fp64), Triton kernels (CUDA or
the interpreter) against the references, and the core layers' fused hooks against their eager
paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flashrec_models_phi.kernels import (
    gelu_tanh_quant_fp8,
    gelu_tanh_quant_fp8_ref,
    layer_norm_quant_fp8,
    layer_norm_quant_fp8_ref,
)

from flashrec_core.layers import BuildContext, GeluTanh, LayerNorm, QuantizedActivation
from flashrec_kernels.testing import assert_fp8_close, assert_ulp_close

# numpy (the interpreter's exp) warns when exp(-2u) overflows for x < ~-10.5; the result,
# x / inf = -0, is GELU's limit, in the reference as well.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

ON_GPU = torch.cuda.is_available()
EPS = 1e-5
# LayerNorm: the kernel sums h and (h - mean)^2 in another order than torch; each pairwise sum
# of N <= 256 terms is off by at most log2(N) fp32 ulps, halved by the sqrt, plus the roundings
# of d * inv * w + b and absmax / 448: a few ulps of the scale. A few fp32 ulps flip an e4m3 code
# only within that distance of a rounding boundary (odds ~2^-18 per element), by one code.
LN_SCALE_ULP = 6  # 3 seen over 300 rows, N up to 2560
# GELU: the interpreter's exp is numpy's, torch's CPU exp its own; on GPU tl.exp and `/` are
# approximate. GELU may differ by an fp32 ulp or two, moving the row absmax (the scale) as much.
GELU_SCALE_ULP = 4 if ON_GPU else 1
CODE_TOL = {"max_ulp": 1, "max_frac": 0.01}


def _ln_inputs(t: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, generator=gen) * 4 + 1.5).to(dtype)  # a non-zero mean to remove
    residual = (torch.randn(t, n, generator=gen) * 4).to(dtype)
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    bias = (0.5 * torch.randn(n, generator=gen)).to(dtype)
    return x, residual, weight, bias


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_ref_matches_torch_layer_norm(with_residual: bool, with_bias: bool) -> None:
    x, residual, weight, bias = _ln_inputs(6, 128, torch.bfloat16)
    bias = bias if with_bias else None
    q, scale, res_out = layer_norm_quant_fp8_ref(
        x, weight, bias, EPS, residual if with_residual else None
    )
    if with_residual:
        # Independent: torch's own bf16 add rounds the fp32 sum once, as the ref must.
        assert torch.equal(res_out, x + residual)
        h = (x + residual).double()
    else:
        assert res_out is None
        h = x.double()
    out64 = F.layer_norm(h, (128,), weight.double(), None if bias is None else bias.double(), EPS)
    scale64 = out64.abs().amax(-1, keepdim=True) / 448
    torch.testing.assert_close(scale.double(), scale64, rtol=2**-21, atol=0)  # a few fp32 ulps
    # Half an e4m3 step (2^-4 relative, 2^-10 * scale subnormal) plus fp32 noise in the ref.
    err = (q.double() * scale.double() - out64).abs()
    assert bool((err <= out64.abs() * (2.0**-4 + 1e-6) + scale64 * 2.0**-10).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_kernel_matches_ref(
    device: torch.device, dtype: torch.dtype, with_residual: bool
) -> None:
    x, residual, weight, bias = (t.to(device) for t in _ln_inputs(7, 96, dtype, seed=1))
    residual = residual if with_residual else None
    q, scale, res_out = layer_norm_quant_fp8(x, weight, bias, EPS, residual)
    q_ref, scale_ref, res_ref = layer_norm_quant_fp8_ref(x, weight, bias, EPS, residual)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=LN_SCALE_ULP, **CODE_TOL)
    if with_residual:
        # Exact: one fp32 add rounded once to x.dtype on both sides.
        assert res_out.dtype == x.dtype and res_out.data_ptr() not in (x.data_ptr(), 0)
        assert_ulp_close(res_out, res_ref, max_ulp=0)
    else:
        assert res_out is None


def test_layer_norm_kernel_without_bias(device: torch.device) -> None:
    x, residual, weight, _ = (t.to(device) for t in _ln_inputs(5, 64, torch.bfloat16, seed=2))
    q, scale, _ = layer_norm_quant_fp8(x, weight, None, EPS, residual)
    q_ref, scale_ref, _ = layer_norm_quant_fp8_ref(x, weight, None, EPS, residual)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=LN_SCALE_ULP, **CODE_TOL)


def test_layer_norm_kernel_strided_rows(device: torch.device) -> None:
    x, residual, weight, bias = (t.to(device) for t in _ln_inputs(5, 256, torch.bfloat16, seed=3))
    x_view, res_view = x[:, :100], residual[:, 128:228]  # N not a power of two: masked lanes
    w, b = weight[:100], bias[:100]
    q, scale, res_out = layer_norm_quant_fp8(x_view, w, b, EPS, res_view)
    q_ref, scale_ref, res_ref = layer_norm_quant_fp8_ref(x_view.contiguous(), w, b, EPS, res_view)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=LN_SCALE_ULP, **CODE_TOL)
    assert_ulp_close(res_out, res_ref, max_ulp=0)


def test_layer_norm_kernel_empty_batch(device: torch.device) -> None:
    x = torch.empty(0, 64, device=device)
    ones = torch.ones(64, device=device)
    q, scale, res_out = layer_norm_quant_fp8(x, ones, ones, EPS, x)
    assert q.shape == (0, 64) and scale.shape == (0, 1) and res_out.shape == (0, 64)


def test_layer_norm_rejects_mismatched_shapes() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        layer_norm_quant_fp8_ref(x, torch.ones(4), None, EPS)
    with pytest.raises(ValueError, match="bias must be"):
        layer_norm_quant_fp8_ref(x, torch.ones(8), torch.ones(3), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        layer_norm_quant_fp8_ref(x, torch.ones(8), None, EPS, torch.zeros(3, 8))


def _gelu_in(t: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, inter, generator=gen) * 3
    x[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -1e20])  # exp overflow, exp -> 0, zeros
    return x.to(dtype)


def test_gelu_ref_matches_torch_gelu_tanh() -> None:
    x = _gelu_in(5, 128, torch.bfloat16)
    q, scale = gelu_tanh_quant_fp8_ref(x)
    out64 = F.gelu(x.double(), approximate="tanh")
    assert q.shape == (5, 128) and scale.shape == (5, 1)
    torch.testing.assert_close(
        scale.double(), out64.abs().amax(-1, keepdim=True) / 448, rtol=2**-20, atol=0
    )  # a few fp32 ulps: the cubic, exp, add, divide each round once
    err = (q.double() * scale.double() - out64).abs()
    assert bool((err <= out64.abs() * (2.0**-4 + 1e-6) + scale.double() * 2.0**-10).all())


def test_gelu_ref_matches_transformers_gelu_new() -> None:
    from transformers.activations import ACT2FN

    x = _gelu_in(4, 64, torch.float32, seed=5)[1:]  # without the 1e20 that overflows x^3
    q, scale = gelu_tanh_quant_fp8_ref(x)
    out = ACT2FN["gelu_new"](x.double())
    err = (q.double() * scale.double() - out).abs()
    assert bool((err <= out.abs() * (2.0**-4 + 1e-6) + scale.double() * 2.0**-10).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_kernel_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    x = _gelu_in(7, 96, dtype, seed=1)
    x = x.clamp(-6e4, 6e4) if dtype == torch.float16 else x  # -1e20 is inf in fp16
    x = x.to(device)
    q, scale = gelu_tanh_quant_fp8(x)
    q_ref, scale_ref = gelu_tanh_quant_fp8_ref(x)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=GELU_SCALE_ULP, **CODE_TOL)


def test_gelu_kernel_strided_rows(device: torch.device) -> None:
    """x as a row-strided view (a slice of a wider GEMM output)."""
    wide = _gelu_in(6, 256, torch.bfloat16, seed=2)[:, 32:132].to(device)  # [6, 100]
    q, scale = gelu_tanh_quant_fp8(wide)
    q_ref, scale_ref = gelu_tanh_quant_fp8_ref(wide.contiguous())
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=GELU_SCALE_ULP, **CODE_TOL)


def test_gelu_kernel_wide_rows_span_several_chunks(device: torch.device) -> None:
    x = _gelu_in(2, 2500, torch.bfloat16, seed=4).to(device)  # 3 chunks of 1024 per pass
    q, scale = gelu_tanh_quant_fp8(x)
    q_ref, scale_ref = gelu_tanh_quant_fp8_ref(x)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=GELU_SCALE_ULP, **CODE_TOL)


def test_gelu_kernel_empty_batch(device: torch.device) -> None:
    q, scale = gelu_tanh_quant_fp8(torch.empty(0, 128, device=device))
    assert q.shape == (0, 128) and scale.shape == (0, 1)


def _ctx(device: torch.device) -> BuildContext:
    return BuildContext(device=device, dtype=torch.bfloat16, fp8_linear=True)


def test_layer_norm_layer_fused_equals_eager_two_stream(device: torch.device) -> None:
    """The core LayerNorm's fused hook: same (y, x + residual) contract as its eager path."""
    x, residual, weight, bias = (t.to(device) for t in _ln_inputs(6, 64, torch.bfloat16, seed=6))
    layers = [
        LayerNorm(64, EPS, _ctx(device), quantize_output=True, fused_kernel=kernel)
        for kernel in (layer_norm_quant_fp8, None)
    ]
    for layer in layers:
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias)
    for res in (None, residual):
        (yf, rf), (ye, re) = (layer(x, res) for layer in layers)
        assert isinstance(yf, QuantizedActivation) and isinstance(ye, QuantizedActivation)
        assert torch.equal(rf, re)  # x itself, or x + residual rounded once to bf16
        # Both quantize the fp32 LayerNorm output (eager does not round it to bf16 first).
        assert_fp8_close(
            yf.data, yf.scale, ye.data, ye.scale, scale_max_ulp=LN_SCALE_ULP, **CODE_TOL
        )


def test_gelu_layer_fused_equals_eager(device: torch.device) -> None:
    x = _gelu_in(5, 96, torch.bfloat16, seed=7)[1:].to(device)
    fused = GeluTanh(quantize_output=True, fused_kernel=gelu_tanh_quant_fp8)(x)
    eager = GeluTanh(quantize_output=True)(x)  # torch's GELU(tanh), also quantized from fp32
    assert_fp8_close(fused.data, fused.scale, eager.data, eager.scale, scale_max_ulp=8, **CODE_TOL)
    plain = GeluTanh(fused_kernel=gelu_tanh_quant_fp8)(x)  # no FP8 consumer: the kernel is unused
    torch.testing.assert_close(plain, F.gelu(x, approximate="tanh"))
