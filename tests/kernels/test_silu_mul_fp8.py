"""silu_mul_quant_fp8: the reference against F.silu in fp64, the Triton kernel against the ref."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrec_kernels import silu_mul_quant_fp8, silu_mul_quant_fp8_ref
from flashrec_kernels.testing import assert_fp8_close

# numpy (the interpreter's exp) warns on the deliberate exp(100) overflow; silu is then -0, as meant.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

ON_GPU = torch.cuda.is_available()
# The interpreter's exp is numpy's and torch's CPU exp is its own vectorized one; on GPU tl.exp is
# the approximate ex2-based exp. Either way silu may differ by an fp32 ulp or two, which can move
# the row absmax (so the scale) by as much, and flips an e4m3 code only within that distance of a
# rounding boundary (odds ~2^-19 per element), by one code.
SCALE_ULP = 4 if ON_GPU else 1
CODE_TOL = {"max_ulp": 1, "max_frac": 0.01}


def _gate_up(t: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(t, 2 * inter, generator=gen) * 3
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow, exp -> 0, zeros
    return gate_up.to(dtype)


def test_ref_matches_float64_formula() -> None:
    gate_up = _gate_up(5, 128, torch.bfloat16)
    q, scale = silu_mul_quant_fp8_ref(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    out64 = F.silu(gate) * up
    assert q.shape == (5, 128) and scale.shape == (5, 1)
    torch.testing.assert_close(
        scale.double(), out64.abs().amax(-1, keepdim=True) / 448, rtol=2**-21, atol=0
    )  # a few fp32 ulps: exp, add, divide and multiply each round once
    # Half an e4m3 step (2^-4 relative, 2^-10 * scale subnormal) plus fp32 noise in the ref.
    err = (q.double() * scale.double() - out64).abs()
    assert bool((err <= out64.abs() * (2.0**-4 + 1e-6) + scale.double() * 2.0**-10).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    gate_up = _gate_up(7, 96, dtype, seed=1).to(device)
    q, scale = silu_mul_quant_fp8(gate_up)
    q_ref, scale_ref = silu_mul_quant_fp8_ref(gate_up)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)


def test_kernel_strided_rows(device: torch.device) -> None:
    """gate_up as a row-strided view (e.g. a slice of a wider GEMM output)."""
    wide = _gate_up(6, 128, torch.bfloat16, seed=2).to(device)
    gate_up = wide[:, 32:224]  # [6, 2 * 96], row stride 256
    q, scale = silu_mul_quant_fp8(gate_up)
    q_ref, scale_ref = silu_mul_quant_fp8_ref(gate_up.contiguous())
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)


def test_kernel_wide_rows_span_several_chunks(device: torch.device) -> None:
    gate_up = _gate_up(2, 2500, torch.bfloat16, seed=4).to(device)  # 2 chunks of 2048 per pass
    q, scale = silu_mul_quant_fp8(gate_up)
    q_ref, scale_ref = silu_mul_quant_fp8_ref(gate_up)
    assert_fp8_close(q, scale, q_ref, scale_ref, scale_max_ulp=SCALE_ULP, **CODE_TOL)


@pytest.mark.parametrize(
    "chunk,num_warps,cache_hints",
    [
        (512, 2, False),
        (1024, 4, False),
        (2048, 8, False),
        (4096, 16, False),
        (2048, 8, True),
        (1024, 4, True),
    ],
)
def test_launch_configurations_give_the_same_codes(
    device: torch.device, chunk: int, num_warps: int, cache_hints: bool
) -> None:
    """scripts/bench_elementwise.py times other launch configurations than the default: they
    split a row among threads differently, or give L2 eviction hints, and must not change a
    code or a scale."""
    from flashrec_kernels.triton_silu_mul import launch_silu_mul_quant_fp8

    gate_up = _gate_up(3, 2500, torch.bfloat16, seed=5).to(device)
    want = launch_silu_mul_quant_fp8(gate_up)
    got = launch_silu_mul_quant_fp8(
        gate_up, chunk=chunk, num_warps=num_warps, cache_hints=cache_hints
    )
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def test_kernel_empty_batch(device: torch.device) -> None:
    q, scale = silu_mul_quant_fp8(torch.empty(0, 128, device=device))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even width"):
        silu_mul_quant_fp8_ref(torch.zeros(2, 7))
