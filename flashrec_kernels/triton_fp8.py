"""Triton helpers that round fp32 onto a narrow format's grid before the cast, and quantize a row.

Why pre-round: the Triton interpreter casts fp32 -> float8e4nv wrongly (a carry into the exponent
halves the value, ties round away from zero, subnormals flush to 0: triton-lang/triton#8322) and
truncates fp32 -> bfloat16 instead of rounding to nearest even. A value already on the target grid
converts exactly under both the interpreter and real GPUs, so every kernel stores through
`cast_for_store`, and the interpreter then matches torch's `.to(dtype)` bit for bit.

Model plugins that ship their own FP8 kernels (GELU->FP8, LayerNorm->FP8) should reuse
`quantize_row_fp8` (a row in registers) or `fp8_scale` + `to_fp8` (a row in chunks), so every
kernel shares one quantizer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fp8

__all__ = [
    "cast_for_store",
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


@triton.jit
def round_to_e4m3(x):
    """fp32 -> fp32 on the e4m3 grid: clamp to +-448, round to nearest even."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    # Normal range: keep 3 of fp32's 23 mantissa bits (drop 20) with RNE; a carry moves the exponent.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range: round x * 2^9 to an integer; the fp32 add rounds once, to nearest even.
    sub = ((x * 512.0 + _RNE_MAGIC) - _RNE_MAGIC) * 0.001953125  # 2^-9, exact
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
        return round_to_e4m3(x).to(dtype)
    elif dtype == tl.bfloat16:
        return round_to_bf16(x).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def fp8_scale(absmax):
    """Per-token scale from a row's absmax: max(absmax, 1e-12) / 448, IEEE-rounded like torch."""
    return tl.math.div_rn(tl.maximum(absmax, MIN_ABSMAX), FP8_MAX)


@triton.jit
def to_fp8(y, scale):
    """e4m3 codes of fp32 `y` under `scale`: clamp(y / scale, -448, 448), rounded to nearest even.

    IEEE division (div_rn) on purpose: Triton's `/` is approximate on GPU, and a 1-ulp error in
    y / scale can flip the FP8 rounding against the torch reference.
    """
    return cast_for_store(tl.math.div_rn(y, tl.broadcast_to(scale, y.shape)), tl.float8e4nv)


@triton.jit
def quantize_row_fp8(y, mask, out_ptrs, scale_ptr):
    """Per-token FP8 of one fp32 row held in registers: store its codes and its scale."""
    scale = fp8_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
    tl.store(out_ptrs, to_fp8(y, scale), mask=mask)
    tl.store(scale_ptr, scale)
