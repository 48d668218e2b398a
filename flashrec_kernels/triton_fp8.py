"""Triton helpers that round fp32 onto a narrow format's grid before the cast, and quantize a row.

Why pre-round: the Triton interpreter casts fp32 -> float8e4nv wrongly (a carry into the exponent
halves the value, ties round away from zero, subnormals flush to 0: triton-lang/triton#8322) and
truncates fp32 -> bfloat16 instead of rounding to nearest even. A value already on the target grid
converts exactly under both the interpreter and real GPUs, so every kernel stores through
`cast_for_store`, and the interpreter then matches torch's `.to(dtype)` bit for bit.

On a real GPU the pre-rounding is skipped: sm_89+ converts with `cvt.rn.satfinite.e4m3x2.f32`
and `cvt.rn.bf16.f32`, which round to nearest even themselves, and the dozen integer and float
instructions a value took there were a third of the SiLU-mul kernel's instructions (its SASS
for sm_90). Likewise `to_fp8` divides by a row's scale through the scale's correctly rounded
reciprocal and two FMAs (`div_rn_by`) instead of an IEEE division per element. Both give
torch's bits; tests/kernels/test_fp8_rounding.py checks each natively on the GPU.

Model plugins that ship their own FP8 kernels (GELU->FP8, LayerNorm->FP8) should reuse
`quantize_row_fp8` (a row in registers) or `fp8_scale` + `to_fp8` (a row in chunks), so every
kernel shares one quantizer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fp8
from .device import triton_interpreting

__all__ = [
    "INTERPRETED",
    "cast_for_store",
    "div_rn_by",
    "fp8_scale",
    "quantize_row_fp8",
    "round_to_bf16",
    "round_to_e4m3",
    "to_fp8",
]

FP8_MAX = tl.constexpr(fp8.FP8_MAX)
MIN_ABSMAX = tl.constexpr(fp8.MIN_ABSMAX)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6; below it e4m3 is subnormal with spacing 2^-9
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding it rounds |y| < 2^22 to an integer (RNE)
INTERPRETED = tl.constexpr(triton_interpreting())
"""Whether the kernels run in Triton's interpreter, decided at import as triton.jit decides it: a
kernel branches on it where the interpreter needs exact arithmetic a GPU does faster."""


@triton.jit
def _clamp_e4m3(x):
    """Clamp to +-448, e4m3fn's largest finite value (it has no inf: past it is NaN)."""
    return tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)


@triton.jit
def round_to_e4m3(x):
    """fp32 -> fp32 on the e4m3 grid: clamp to +-448, round to nearest even."""
    x = _clamp_e4m3(x)
    # Normal range: keep 3 of fp32's 23 mantissa bits (drop 20) with RNE; a carry moves the exponent.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range: round x * 2^9 to an integer; the fp32 add rounds once, to nearest even.
    sub = ((x * 512.0 + _RNE_MAGIC) - _RNE_MAGIC) * 0.001953125  # 2^-9, exact
    # The add loses the sign of what rounds to zero (-2^-11 became +0 where torch gives -0):
    # put x's sign bit back (a no-op on every nonzero result, which already carries it).
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # the sign bit, 0x80000000
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < _E4M3_MIN_NORMAL, sub, normal)


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 on the bfloat16 grid (RNE), so a truncating cast is exact."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == ~0xFFFF
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_for_store(x, dtype: tl.constexpr):
    """fp32 -> `dtype` the way torch's `.to(dtype)` does (FP8 additionally clamped to +-448)."""
    if dtype == tl.float8e4nv:
        if INTERPRETED:
            return round_to_e4m3(x).to(dtype)
        return _clamp_e4m3(x).to(dtype)  # the conversion rounds (cvt.rn.satfinite)
    elif dtype == tl.bfloat16:
        if INTERPRETED:
            return round_to_bf16(x).to(dtype)
        return x.to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def fp8_scale(absmax):
    """Per-token scale from a row's absmax: max(absmax, 1e-12) / 448, IEEE-rounded like torch."""
    return tl.math.div_rn(tl.maximum(absmax, MIN_ABSMAX), FP8_MAX)


@triton.jit
def to_fp8(y, scale):
    """e4m3 codes of fp32 `y` under `scale`: clamp(y / scale, -448, 448), rounded to nearest even.

    The quotient is IEEE's (correctly rounded, `div_rn_by`) on purpose: Triton's `/` is
    approximate on GPU, and a 1-ulp error in y / scale can flip the FP8 rounding against the
    torch reference.
    """
    return cast_for_store(div_rn_by(y, scale), tl.float8e4nv)


@triton.jit
def div_rn_by(y, d):
    """y / d rounded to nearest even (IEEE's quotient), `d` broadcasting against `y` (a row's
    scale). On a GPU with one IEEE division per value of `d` instead of one per element: from
    inv = 1 / d correctly rounded, q = y inv, then one FMA correction (Markstein's step: the
    remainder r = y - q d, then q + r inv, each rounded once). With a correctly rounded
    reciprocal one step gives IEEE's quotient (Muller, "Accelerating floating-point division
    when the divisor is known in advance", 2002); tests/kernels/test_fp8_rounding.py checks it
    bit for bit on pairs chosen to flip FP8 codes, natively and in exact arithmetic. Quotients
    under 2^-120 (FP8 zeros either way) are outside that check. The interpreter's fma rounds
    twice, so there it divides."""
    if INTERPRETED:
        return tl.math.div_rn(y, tl.broadcast_to(d, y.shape))
    inv = tl.math.div_rn(1.0, d)
    q = y * inv
    r = tl.fma(-q, d, y)
    return tl.fma(r, inv, q)


@triton.jit
def quantize_row_fp8(y, mask, out_ptrs, scale_ptr):
    """Per-token FP8 of one fp32 row held in registers: store its codes and its scale."""
    scale = fp8_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
    tl.store(out_ptrs, to_fp8(y, scale), mask=mask)
    tl.store(scale_ptr, scale)
