"""Beam-cascade attention of one decode step: each beam row attends its request's prompt + its own slots.

Shapes (R beam rows of B requests, S own slots per row, page size 1):
    q              [R, Hq, D] bf16, unit stride on D (may be a view of the fused qkv buffer)
    k_cache        [num_slots, Hkv, D] bf16 or float8_e4m3fn (FP8 used as-is: no scale); v_cache alike
    prefix_indptr  int32 [B + 1]; request b's prompt slots are prefix_indices[indptr[b]:indptr[b+1]]
    prefix_indices int32 [prefix_indptr[B]]; every request has at least one prompt slot
    row_indptr     int32 [B + 1]; request b's rows are q[row_indptr[b]:row_indptr[b+1]], in order
    suffix         int32 [R, S]; row r's own slots (ancestors + the one written this step), S >= 1;
                   a negative entry is no slot (a row with fewer own slots than S pads with -1)
For q head h (kv head h // (Hq // Hkv)) of row r of request b:
    o[r, h] = softmax_j(cap(sm_scale * q[r, h] . k[j])) @ v[j], j over prompt slots of b ∪ suffix[r]
with cap(s) = s, or logit_softcap * tanh(s / logit_softcap) when a soft-cap is given;
non-causal, computed in fp32 and rounded to bf16. A sliding window needs no kernel support: all
rows of a request sit at the same position, so the caller passes only the prompt slots inside
the window (`flashrec_core.attention` does). It is exactly attention over the union, i.e.
FlashInfer's cascade (prefix prefill + suffix decode + merge_state) in one pass. Rows outside
[row_indptr[0], row_indptr[B]) are not written by the kernel (zero in the reference).
"""

from __future__ import annotations

import torch

from .device import check_triton_device
from .fp8 import FP8_DTYPE

__all__ = ["beam_cascade_attention", "beam_cascade_attention_ref", "check_beam_attention_args"]

_KERNEL = "beam_cascade_attention"
_INDEX_DTYPE = torch.int32
_CACHE_DTYPES = (torch.bfloat16, FP8_DTYPE)


def _fail(msg: str) -> None:
    raise ValueError(f"{_KERNEL}: {msg}")


def _check_q_and_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.stride(2) != 1:
        _fail(f"q must be bf16 [R, Hq, D] with unit stride on D; got {q.dtype} {tuple(q.shape)}")
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        _fail(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[2] != head_dim or c.stride(2) != 1:
            _fail(
                f"{name} must be [num_slots, Hkv, {head_dim}] with unit stride on D, got {c.shape}"
            )
        if c.dtype not in _CACHE_DTYPES:
            _fail(f"{name} must be bf16 or {FP8_DTYPE}, got {c.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        _fail(
            f"k_cache {k_cache.dtype}{tuple(k_cache.shape)} != v_cache {v_cache.dtype}{v_cache.shape}"
        )
    if q.shape[1] % k_cache.shape[1] != 0:
        _fail(f"Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[1]}")


def _check_indices(
    q: torch.Tensor,
    prefix_indptr: torch.Tensor,
    prefix_indices: torch.Tensor,
    row_indptr: torch.Tensor,
    suffix: torch.Tensor,
    max_rows_per_request: int,
) -> None:
    for name, t in (("prefix_indptr", prefix_indptr), ("row_indptr", row_indptr)):
        if t.dim() != 1 or t.numel() < 2 or t.dtype != _INDEX_DTYPE:
            _fail(f"{name} must be int32 [B + 1] with B >= 1, got {t.dtype} {tuple(t.shape)}")
    if prefix_indptr.shape != row_indptr.shape:
        _fail(
            f"prefix_indptr {prefix_indptr.shape} and row_indptr {row_indptr.shape} disagree on B"
        )
    if prefix_indices.dim() != 1 or prefix_indices.dtype != _INDEX_DTYPE:
        _fail(
            f"prefix_indices must be int32 [N], got {prefix_indices.dtype} {prefix_indices.shape}"
        )
    if suffix.dim() != 2 or suffix.shape[0] != q.shape[0] or suffix.shape[1] < 1:
        _fail(f"suffix must be [R={q.shape[0]}, S >= 1], got {tuple(suffix.shape)}")
    if suffix.dtype != _INDEX_DTYPE:
        _fail(f"suffix must be int32, got {suffix.dtype}")
    if not isinstance(max_rows_per_request, int) or max_rows_per_request < 1:
        _fail(f"max_rows_per_request must be a positive int, got {max_rows_per_request!r}")


def attention_output(q: torch.Tensor, out: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """The output buffer of an attention kernel: `out` checked (contiguous bf16 of q's shape, so
    a CUDA graph can keep it), or a new one."""
    if out is None:
        return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(
            f"{kernel}: out must be contiguous bf16 {tuple(q.shape)}, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    return out


def _check_softcap(logit_softcap: float | None) -> None:
    if logit_softcap is not None and not logit_softcap > 0:
        _fail(f"logit_softcap must be None or > 0, got {logit_softcap!r}")


def check_beam_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_indptr: torch.Tensor,
    prefix_indices: torch.Tensor,
    row_indptr: torch.Tensor,
    suffix: torch.Tensor,
    max_rows_per_request: int,
) -> None:
    """Validate shapes and dtypes only (no device reads, so it is safe inside a CUDA graph)."""
    _check_q_and_caches(q, k_cache, v_cache)
    _check_indices(q, prefix_indptr, prefix_indices, row_indptr, suffix, max_rows_per_request)


def _request_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    sm_scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One request: q [n, Hq, D], prefix [P], suffix [n, S] -> o [n, Hq, D] in fp32."""
    group = q.shape[1] // k_cache.shape[1]
    qf = q.float()
    kp = k_cache[prefix].float().repeat_interleave(group, dim=1)  # [P, Hq, D]
    vp = v_cache[prefix].float().repeat_interleave(group, dim=1)
    used = suffix.clamp(min=0)  # negative = no slot: masked below, any row can stand in
    ks = k_cache[used].float().repeat_interleave(group, dim=2)  # [n, S, Hq, D]
    vs = v_cache[used].float().repeat_interleave(group, dim=2)
    scores = torch.cat(
        [torch.einsum("nhd,phd->nhp", qf, kp), torch.einsum("nhd,nshd->nhs", qf, ks)], dim=-1
    )
    scores = scores * sm_scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    num_prefix = prefix.numel()
    scores[..., num_prefix:].masked_fill_((suffix < 0)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [n, Hq, P + S]
    return torch.einsum("nhp,phd->nhd", probs[..., :num_prefix], vp) + torch.einsum(
        "nhs,nshd->nhd", probs[..., num_prefix:], vs
    )


def beam_cascade_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_indptr: torch.Tensor,
    prefix_indices: torch.Tensor,
    row_indptr: torch.Tensor,
    suffix: torch.Tensor,
    sm_scale: float,
    max_rows_per_request: int,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Torch reference (fp32 math, a host loop over requests): o [R, Hq, D] bf16."""
    check_beam_attention_args(
        q, k_cache, v_cache, prefix_indptr, prefix_indices, row_indptr, suffix, max_rows_per_request
    )
    _check_softcap(logit_softcap)
    out = torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
    prefix_bounds, row_bounds = prefix_indptr.tolist(), row_indptr.tolist()
    for b in range(len(row_bounds) - 1):
        r0, r1 = row_bounds[b], row_bounds[b + 1]
        p0, p1 = prefix_bounds[b], prefix_bounds[b + 1]
        if r1 - r0 > max_rows_per_request:
            _fail(f"request {b} has {r1 - r0} rows > max_rows_per_request={max_rows_per_request}")
        if p1 <= p0:
            _fail(f"request {b} has no prefix slots; every request needs at least one")
        if r1 > r0:
            prefix, rows = prefix_indices[p0:p1].long(), suffix[r0:r1].long()
            o = _request_ref(q[r0:r1], k_cache, v_cache, prefix, rows, sm_scale, logit_softcap)
            out[r0:r1] = o.to(torch.bfloat16)
    return out


def beam_cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_indptr: torch.Tensor,
    prefix_indices: torch.Tensor,
    row_indptr: torch.Tensor,
    suffix: torch.Tensor,
    sm_scale: float,
    max_rows_per_request: int,
    out: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,
    fp8_scores: bool = False,
) -> torch.Tensor:
    """Triton version of `beam_cascade_attention_ref`; no host syncs, so it captures in a graph.

    The grid is static: (B, Hkv, query tiles of max_rows_per_request rows x the GQA group), so
    a request with more rows than max_rows_per_request gets only its first rows computed (the
    bound is the caller's invariant; the reference checks it). `out` ([R, Hq, D] bf16,
    contiguous) lets a graph keep its output buffer; otherwise a new one is allocated.
    `num_splits` cuts each prompt into that many ranges run in parallel and merged (split-KV;
    a power of two up to 16); by default it follows from the grid size and the GPU's SMs, so
    that a step of one or a few requests still fills the GPU. `fp8_scores` (experimental, an
    FP8 cache only): the prompt's score dot on FP8 operands, each query row rounded to e4m3
    under its own scale (`launch_beam_cascade_attention`).
    """
    check_beam_attention_args(
        q, k_cache, v_cache, prefix_indptr, prefix_indices, row_indptr, suffix, max_rows_per_request
    )
    _check_softcap(logit_softcap)
    check_triton_device(q, _KERNEL)
    out = attention_output(q, out, _KERNEL)
    from .triton_beam_attention import launch_beam_cascade_attention

    launch_beam_cascade_attention(
        q, k_cache, v_cache, prefix_indptr, prefix_indices, row_indptr, suffix, sm_scale,
        max_rows_per_request, out, logit_softcap=logit_softcap, num_splits=num_splits,
        fp8_scores=fp8_scores,
    )  # fmt: skip
    return out
