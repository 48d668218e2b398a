"""gelu_tanh_mul_quant_fp8 (GeGLU -> FP8): the reference against F.gelu(tanh) in fp64, the
Triton kernel (the SwiGLU kernel with ACT=GELU) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrec_kernels import gelu_tanh_mul_quant_fp8, gelu_tanh_mul_quant_fp8_ref
from flashrec_kernels.testing import assert_fp8_close

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

ON_GPU = torch.cuda.is_available()
SCALE_ULP = 4 if ON_GPU else 1  # as for SiLU*mul: exp may differ by an fp32 ulp or two
CODE_TOL = {"max_ulp": 1, "max_frac": 0.01}


def _gate_up(t: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(t, 2 * inter, generator=gen) * 3
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow, exp -> 0, zeros
    return gate_up.to(dtype)


def test_ref_matches_float64_formula() -> None:
    gate_up = _gate_up(5, 128, torch.bfloat16)
    q, scale = gelu_tanh_mul_quant_fp8_ref(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    out64 = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(
        scale.double(), out64.abs().amax(-1, keepdim=True) / 448, rtol=2**-20, atol=0
    )  # a few fp32 ulps: the cubic, exp, add, divide and multiply each round once
    err = (q.double() * scale.double() - out64).abs()
    assert bool((err <= out64.abs() * (2.0**-4 + 1e-6) + scale.double() * 2.0**-10).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    gate_up = _gate_up(7, 96, dtype, seed=1).to(device)
    q, scale = gelu_tanh_mul_quant_fp8(gate_up)
    q_ref, scale_ref = gelu_tanh_mul_quant_fp8_ref(gate_up)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)


def test_kernel_strided_rows_over_several_chunks(device: torch.device) -> None:
    wide = _gate_up(3, 1300, torch.bfloat16, seed=2).to(device)
    gate_up = wide[:, 100:2500]  # [3, 2 * 1200], row stride 2600: two chunks per pass
    q, scale = gelu_tanh_mul_quant_fp8(gate_up)
    q_ref, scale_ref = gelu_tanh_mul_quant_fp8_ref(gate_up.contiguous())
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)
