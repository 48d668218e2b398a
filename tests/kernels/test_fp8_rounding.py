"""The pre-rounding store helper must reproduce torch's casts bit for bit, interpreter included."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, FP8_MAX
from flashrec_kernels.testing import ulp_distance

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from flashrec_kernels.triton_fp8 import cast_for_store  # noqa: E402  (needs triton)


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value as fp32 (254 of 256 codes; 0x7F/0xFF are NaN)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return values[values.isfinite()]


def _tricky_e4m3_inputs() -> torch.Tensor:
    """Grid points, exact midpoints (ties), midpoints +-1 fp32 ulp, out-of-range and random values."""
    pos = _e4m3_grid().unique().clamp(min=0).unique()  # [0, 2^-9, ..., 448]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32: the ties RNE must break to even
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    below = torch.nextafter(mids, torch.zeros_like(mids))
    carry = torch.tensor([31.2, 31.9, 0.0156, 0.0155, 0.00195, 0.00097, 0.00098, 447.0, 449.0])
    beyond = torch.tensor([460.0, 464.0, 500.0, 1e6, 3e38])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(2000, generator=gen) * torch.exp2(
        torch.randint(-12, 9, (2000,), generator=gen)
    )
    x = torch.cat([pos, mids, above, below, carry, beyond, rand])
    return torch.cat([x, -x])


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, cast_for_store(x, y_ptr.dtype.element_ty), mask=offs < n)


def _run_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = 1024
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


def test_cast_for_store_fp8_matches_torch_bit_for_bit(device: torch.device) -> None:
    x = _tricky_e4m3_inputs().to(device)
    expected = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    got = _run_cast(x, FP8_DTYPE)
    # Exact: the whole point of the helper is that the cast sees values already on the grid.
    assert int(ulp_distance(got, expected).max()) == 0


def test_cast_for_store_fp8_keeps_ties_and_carries(device: torch.device) -> None:
    """Spot checks of the cases the interpreter gets wrong without pre-rounding (#8322)."""
    x = torch.tensor([31.2, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 1000.0])
    # 31.2 carries into the next binade; 17 and 19 are ties (to even: 16, 20); 2^-10 ties to 0,
    # 3 * 2^-10 ties to 2^-8 (even subnormal code 2); out of range saturates to 448.
    expected = torch.tensor([32.0, 16.0, 20.0, 0.0, 2.0**-8, 448.0])
    got = _run_cast(x.to(device), FP8_DTYPE)
    assert torch.equal(got.float().cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_for_store_other_dtypes_match_torch(device: torch.device, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * 3
    # bf16 ties (7 mantissa bits kept, the 8th set, the rest zero) must round to even.
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 2 - 2.0**-9, -(1 + 2.0**-8)])
    x = torch.cat([x, ties]).to(device)
    got = _run_cast(x, dtype)
    assert int(ulp_distance(got, x.to(dtype)).max()) == 0
