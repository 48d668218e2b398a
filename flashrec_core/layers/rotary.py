"""Rotary position embedding (neox style, partial rotary, HF `rope_scaling` types).

One module per model owns the cos/sin cache. Called on the per-head q/k views of the fused qkv
buffer, it applies the optional q/k RMSNorm and RoPE and, when the fused kernel is enabled, also
stores K/V into the pool in the same pass (and into a fresh prefill's key buffers, when the
backend hands them out) and reports it so attention skips its own store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.norm import rms_norm
from flashrec_core.spec import RopeConfig

if TYPE_CHECKING:
    from flashrec_core.layers.batch import ForwardBatch
    from flashrec_core.layers.norm import RMSNorm


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the attention scaling folded into cos/sin."""
    dim = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    if rope.scaling_type == "yarn":
        return _yarn_inv_freq(rope)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    assert rope.original_max_position is not None, "parse_rope requires it for llama3"
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    assert rope.original_max_position is not None, "parse_rope fills it for yarn"
    max_pos = rope.original_max_position

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1 / pos_freqs
    ) * extrapolation_factor
    scaling = rope.attention_factor
    if scaling is None and rope.mscale and rope.mscale_all_dim:
        scaling = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    elif scaling is None:
        scaling = _yarn_mscale(factor)
    return inv_freq, scaling


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of the first rotary_dim dims of x [T, H, D]; cos/sin are [T, rotary_dim/2]."""
    half = cos.shape[-1]
    x32 = x.float()
    x1, x2, rest = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Owns the cos|sin cache [max_position, rotary_dim] (fp32) shared by every layer."""

    def __init__(
        self,
        rope: RopeConfig,
        max_position: int,
        ctx: BuildContext,
        *,
        fused_kernel: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rope.rotary_dim
        inv_freq, scaling = rope_inv_freq(rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)
        self.fused_kernel = fused_kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        layer_id: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Returns (q, k, stored): `stored` tells attention the K/V are already in the pool."""
        if self.fused_kernel is not None:
            pool = batch.kv_pool
            self.fused_kernel(
                q, k, v, batch.positions, self.cos_sin_cache,
                pool.k_cache[layer_id], pool.v_cache[layer_id], batch.out_cache_loc,
                q_norm_weight=None if q_norm is None else q_norm.gain(),
                k_norm_weight=None if k_norm is None else k_norm.gain(),
                eps=q_norm.eps if q_norm is not None else 1e-6,
                rotary_dim=self.rotary_dim, mirror=batch.claim_kv_mirror(layer_id),
            )  # fmt: skip
            return q, k, True
        if q_norm is not None:
            q = rms_norm(q, q_norm.weight, q_norm.eps, q_norm.weight_offset)
        if k_norm is not None:
            k = rms_norm(k, k_norm.weight, k_norm.eps, k_norm.weight_offset)
        cos, sin = self.cos_sin_cache[batch.positions].chunk(2, dim=-1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), False
