"""Fused per-head QK-RMSNorm (optional) + neox RoPE (partial rotary) + KV-cache store.

q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] are usually strided views into one fused qkv buffer
[T, (Hq + 2 Hkv) D]; only the last dim needs unit stride. q and k are modified in place, in fp32:
    h               = x * (1 / sqrt(mean(x^2 over D) + eps)) * norm_weight   (only if given)
    r               = rotary_dim; dims [0, r/2) and [r/2, r) rotate, dims [r, D) pass through
    out[:r/2]       = h[:r/2] * cos - h[r/2:r] * sin
    out[r/2:r]      = h[r/2:r] * cos + h[:r/2] * sin
then rounded to q.dtype. k_cache[out_loc] / v_cache[out_loc] receive k (as stored in place, so the
cache equals what an unfused store of k would write) and v, cast to the cache dtype; an FP8 cache
is a plain cast (scale 1.0) clamped to +-448. cos_sin_cache is [max_pos, r]: cos in columns
[0, r/2), sin in [r/2, r). A model without qk-norm passes no norm weights and gets no norm.

`mirror` = (k_out, v_out, rows), optional: token i's k (as stored in place) and v also go to row
rows[i] of k_out / v_out [N, Hkv, D] in k's dtype, exact copies. A fresh prefill attends over
those buffers (flashrec_core/attention/fresh_prefill.py); writing them here saves a pass that
reads k and v back.
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import FP8_DTYPE, FP8_MAX

__all__ = ["rope_norm_store", "rope_norm_store_ref"]

_KERNEL = "rope_norm_store"


def _fail(msg: str) -> None:
    raise ValueError(f"{_KERNEL}: {msg}")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        _fail(f"need q [T, Hq, D], k and v [T, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        _fail(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    if q.dtype != k.dtype:
        _fail(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] > 1 and t.stride(2) != 1:
            _fail(f"{name} needs unit stride along D, got strides {t.stride()}")


def _check_caches(k: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[1:] != k.shape[1:]:
            _fail(f"{name} must be [num_slots, {k.shape[1]}, {k.shape[2]}], got {tuple(c.shape)}")
        if c.stride(2) != 1:
            _fail(f"{name} needs unit stride along D, got strides {c.stride()}")


def _check_rotary(q: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int | None) -> int:
    width = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        _fail(f"cos_sin_cache must be [max_pos, rotary_dim], got {tuple(cos_sin_cache.shape)}")
    if rotary_dim is not None and rotary_dim != width:
        _fail(f"rotary_dim={rotary_dim} but cos_sin_cache has {width} columns")
    if width % 2 != 0 or not 0 < width <= q.shape[2]:
        _fail(f"rotary_dim must be even and in (0, head_dim={q.shape[2]}], got {width}")
    return width


Mirror = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(k_out, v_out, rows): where a fused store also copies each token's k and v."""


def _check_mirror(k: torch.Tensor, mirror: Mirror) -> None:
    k_out, v_out, rows = mirror
    for name, buf in (("mirror k_out", k_out), ("mirror v_out", v_out)):
        if buf.dim() != 3 or buf.shape[1:] != k.shape[1:] or buf.dtype != k.dtype:
            _fail(
                f"{name} must be [rows, {k.shape[1]}, {k.shape[2]}] in {k.dtype}, got "
                f"{buf.dtype} {tuple(buf.shape)}"
            )
        if buf.stride(2) != 1:
            _fail(f"{name} needs unit stride along D, got strides {buf.stride()}")
    if rows.shape != (k.shape[0],) or rows.dtype not in (torch.int64, torch.int32):
        _fail(f"mirror rows must be int64/int32 [{k.shape[0]}], got {rows.dtype} {rows.shape}")


def check_rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    norm_weights: tuple[torch.Tensor | None, torch.Tensor | None],
    rotary_dim: int | None,
    mirror: Mirror | None = None,
) -> int:
    """Validate every argument of `rope_norm_store`; return the rotary dim (default: cache width)."""
    _check_heads(q, k, v)
    _check_caches(k, k_cache, v_cache)
    if mirror is not None:
        _check_mirror(k, mirror)
    num_tokens = q.shape[0]
    for name, idx in (("positions", positions), ("out_loc", out_loc)):
        if idx.shape != (num_tokens,) or idx.dtype not in (torch.int64, torch.int32):
            _fail(f"{name} must be int64/int32 [{num_tokens}], got {idx.dtype} {idx.shape}")
    for name, w in zip(("q_norm_weight", "k_norm_weight"), norm_weights, strict=True):
        if w is not None and w.shape != (q.shape[2],):
            _fail(f"{name} must be [{q.shape[2]}], got {tuple(w.shape)}")
    return _check_rotary(q, cos_sin_cache, rotary_dim)


def _norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, r/2] -> normed and rotated x in fp32."""
    h = x.float()
    if weight is not None:
        h = h * (1.0 / torch.sqrt(h.square().mean(dim=-1, keepdim=True) + eps)) * weight.float()
    half = cos.shape[-1]
    x1, x2 = h[..., :half], h[..., half : 2 * half]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, h[..., 2 * half :]], dim=-1)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8_DTYPE:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)  # e4m3fn has no inf: clamp first
    return x.to(dtype)


def rope_norm_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rotary_dim: int | None = None,
    mirror: Mirror | None = None,
) -> None:
    """Torch reference: modifies q, k in place and writes k, v into the caches at out_loc
    (and into the mirror's rows)."""
    norm_weights = (q_norm_weight, k_norm_weight)
    rotary_dim = check_rope_args(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc, norm_weights, rotary_dim,
        mirror,
    )  # fmt: skip
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)  # [T, 1, r/2] each
    q.copy_(_norm_rope_ref(q, q_norm_weight, eps, cos, sin))
    k.copy_(_norm_rope_ref(k, k_norm_weight, eps, cos, sin))
    k_cache[out_loc] = _to_cache(k, k_cache.dtype)
    v_cache[out_loc] = _to_cache(v, v_cache.dtype)
    if mirror is not None:
        k_out, v_out, rows = mirror
        k_out[rows] = k
        v_out[rows] = v


def rope_norm_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rotary_dim: int | None = None,
    mirror: Mirror | None = None,
) -> None:
    """Triton version of `rope_norm_store_ref`: one program per (token, block of up to 16 heads)."""
    norm_weights = (q_norm_weight, k_norm_weight)
    rotary_dim = check_rope_args(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc, norm_weights, rotary_dim,
        mirror,
    )  # fmt: skip
    check_triton_device(q, _KERNEL)
    from .triton_rope import launch_rope_norm_store

    launch_rope_norm_store(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_loc, norm_weights, eps,
        rotary_dim, mirror=mirror,
    )  # fmt: skip
