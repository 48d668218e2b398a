"""Comparison helpers for kernel-vs-reference tests, in units of the output format's ulp.

Shipped in the package (not under tests/) because model plugins test their own FP8 kernels
(GELU->FP8, LayerNorm->FP8) against their references with the same yardstick.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE

__all__ = ["assert_fp8_close", "assert_ulp_close", "ulp_distance"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_E4M3_REL_ULP = 2.0**-3  # 3 mantissa bits: neighbouring normal codes differ by at most 1/8 relative
_E4M3_SUBNORMAL_ULP = 2.0**-9  # spacing of subnormal codes, in units of the scale


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the (shared) float dtype lie between a and b, as int64."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    bits = a.element_size() * 8
    magnitude = (1 << (bits - 1)) - 1

    def ordinal(t: torch.Tensor) -> torch.Tensor:
        raw = t.contiguous().view(_INT_VIEW[t.element_size()]).to(torch.int64)
        return torch.where(raw < 0, -(raw & magnitude), raw)  # sign-magnitude -> monotonic line

    return (ordinal(a) - ordinal(b)).abs()


def assert_ulp_close(
    actual: torch.Tensor, expected: torch.Tensor, *, max_ulp: int = 0, max_frac: float = 0.0
) -> None:
    """Every element within max_ulp ulps, and at most max_frac of them differ at all."""
    dist = ulp_distance(actual, expected)
    if dist.numel() == 0:
        return
    worst, frac = int(dist.max()), float((dist > 0).double().mean())
    assert worst <= max_ulp and frac <= max_frac, (
        f"{actual.dtype}: worst {worst} ulp (allowed {max_ulp}), {frac:.2%} of elements differ "
        f"(allowed {max_frac:.2%}); first mismatches at {(dist > 0).nonzero()[:5].tolist()}"
    )


def assert_fp8_close(
    q: torch.Tensor,
    scale: torch.Tensor,
    q_ref: torch.Tensor,
    scale_ref: torch.Tensor,
    *,
    max_ulp: int = 0,
    max_frac: float = 0.0,
    scale_max_ulp: int = 0,
) -> None:
    """Compare per-token FP8 outputs: scales in fp32 ulps, codes in e4m3 ulps, then dequantized.

    The dequantized bound follows from the code bound: max_ulp e4m3 steps are at most
    max_ulp / 8 relative for normal codes and max_ulp * 2^-9 * scale absolute for subnormal ones.
    """
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32, f"{q.dtype}, {scale.dtype}"
    assert_ulp_close(scale, scale_ref, max_ulp=scale_max_ulp, max_frac=1.0)
    assert_ulp_close(q, q_ref, max_ulp=max_ulp, max_frac=max_frac)
    if max_ulp == 0:  # exact means the same bytes: ulps count -0 and +0 as one value
        differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
        assert not bool(differ.any()), (
            f"codes differ in sign only at {differ.nonzero()[:5].tolist()}"
        )
    deq, deq_ref = q.float() * scale, q_ref.float() * scale_ref
    # A scale off by k fp32 ulps moves each product by k ulps, plus one for the product's rounding.
    scale_slack = (scale_max_ulp + 1) * 2.0**-23 if scale_max_ulp else 0.0
    torch.testing.assert_close(
        deq,
        deq_ref,
        rtol=max_ulp * _E4M3_REL_ULP + scale_slack,
        atol=float(scale_ref.max()) * max_ulp * _E4M3_SUBNORMAL_ULP if deq.numel() else 0.0,
    )
