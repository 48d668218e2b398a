"""The store helper must reproduce torch's casts bit for bit, and `div_rn_by` IEEE's quotient,
natively on a GPU (hardware conversions, a reciprocal and FMAs) and in the interpreter
(pre-rounding, IEEE division)."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, FP8_MAX
from flashrec_kernels.testing import ulp_distance

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from flashrec_kernels.triton_fp8 import cast_for_store, div_rn_by  # noqa: E402  (needs triton)

ON_GPU = torch.cuda.is_available()


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
    # Bit for bit, signed zeros included (ulp distance counts -0 and +0 as equal; the
    # interpreter's pre-rounding once turned small negatives into +0 where torch gives -0)
    differ = got.view(torch.uint8) != expected.view(torch.uint8)
    assert not bool(differ.any()), (x[differ][:6], got[differ][:6], expected[differ][:6])


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


def _divisions(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, d) fp32 pairs as `to_fp8` divides them: d a row scale over 2^-40..2^20, a third with
    all-ones low significands (where a rounded reciprocal is least accurate), y = d times a
    quotient in [-448, 448], half of the quotients at e4m3 rounding midpoints, each y then
    moved by -2..2 ulps (the pairs whose FP8 code one ulp of error would flip)."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.exp2(torch.empty(n).uniform_(-40, 20, generator=gen))
    ones = torch.rand(n, generator=gen) < 0.3
    d_bits = d.view(torch.int32)
    d_bits[ones] |= 0x7FFF00 | torch.randint(0, 256, (int(ones.sum()),), generator=gen,
                                             dtype=torch.int32)  # fmt: skip
    d = d_bits.view(torch.float32)
    quotient = torch.empty(n).uniform_(-448, 448, generator=gen)
    k = torch.randint(-9, 9, (n,), generator=gen).float()
    m = torch.randint(0, 8, (n,), generator=gen).float()
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    at_mid = torch.rand(n, generator=gen) < 0.5
    quotient[at_mid] = (sign * (1 + (2 * m + 1) / 16) * torch.exp2(k))[at_mid]
    y = (quotient * d).view(torch.int32) + torch.randint(-2, 3, (n,), generator=gen,
                                                         dtype=torch.int32)  # fmt: skip
    return y.view(torch.float32), d


@triton.jit
def _divide_kernel(y_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs, mask=offs < n, other=0.0)
    d = tl.load(d_ptr + offs, mask=offs < n, other=1.0)
    tl.store(out_ptr + offs, div_rn_by(y, d), mask=offs < n)


def test_div_rn_by_is_ieee_division(device: torch.device) -> None:
    """On a GPU: the reciprocal and two FMAs give IEEE's quotient bit for bit (16M pairs)."""
    y, d = _divisions(1 << 24 if ON_GPU else 4096, seed=2)
    y, d = y.to(device), d.to(device)
    expected = y / d  # a tensor divisor: IEEE division on CUDA and CPU
    got = torch.empty_like(y)
    block = 1024
    _divide_kernel[(triton.cdiv(y.numel(), block),)](y, d, got, y.numel(), BLOCK=block)
    tiny = expected.abs() < 2.0**-120  # underflow is outside the formula's claim (FP8 zero there)
    mismatch = (got.view(torch.int32) != expected.view(torch.int32)) & ~tiny
    assert int(mismatch.sum()) == 0, (y[mismatch][:4], d[mismatch][:4], got[mismatch][:4])


def test_reciprocal_division_formula_is_exact_in_exact_arithmetic() -> None:
    """The GPU path of `div_rn_by` replayed with exact roundings (numpy fp32, remainders in
    fp64 where they are exact) on 2M pairs: one correction step from the rounded reciprocal
    always lands on IEEE's quotient. Without a GPU this is what shows the formula is right."""
    np = pytest.importorskip("numpy")
    y_t, d_t = _divisions(1 << 21, seed=3)
    y, d = y_t.numpy(), d_t.numpy()
    inv = np.float32(1) / d
    q = y * inv
    # y - q d: q d is exact in fp64 (48 bits) and cancels against y, so the sum is exact too
    r = (y.astype(np.float64) - q.astype(np.float64) * d.astype(np.float64)).astype(np.float32)
    s = r.astype(np.float64) * inv.astype(np.float64) + q.astype(np.float64)
    # fp64 then fp32 rounds twice; that differs from one rounding only on an fp32 midpoint
    assert not bool(((s.view(np.uint64) & ((1 << 29) - 1)) == (1 << 28)).any())
    got = s.astype(np.float32)
    expected = y / d
    ok = np.abs(expected) >= 2.0**-120
    assert int((got != expected)[ok].sum()) == 0
