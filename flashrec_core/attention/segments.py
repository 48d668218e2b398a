"""Steps of different kinds through one model forward: each segment's attention apart, the rest
of the forward over every row at once.

A mixed batch (vLLM's and SGLang's chunked prefill carry decode tokens inside a prefill's
forward) is the groundwork of the latency-tail design in docs/architecture.md: an admitted
prompt's prefill and the beam steps of the waves in flight read the weights once, instead of
once per forward. Everything in a decoder layer but attention is row-wise (norms, projections,
RoPE at each token's position, the KV store at each token's slot), so only attention needs to
know where one step ends and the next begins: `SegmentPlans` holds each step's own plan from the
wrapped backend, and `SegmentedAttention.forward` runs each segment's queries through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashrec_core.attention.base import AttentionBackend
    from flashrec_core.attention.step import StepInput
    from flashrec_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class SegmentPlans:
    """Step i's tokens are rows bounds[i]:bounds[i + 1] of the forward; plans[i] is its plan."""

    bounds: tuple[int, ...]
    plans: tuple[Any, ...]


class SegmentedAttention:
    """The attention of a forward over several steps, each segment through `inner` with its own
    plan. Stateless: one wraps the runner's backend for each segmented forward."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = f"segments({inner.name})"

    def plan(self, steps: Sequence[StepInput], graphs: Sequence[Any] | None = None) -> SegmentPlans:
        """Each step planned by the wrapped backend, in order; with `graphs`, step i into the
        fixed buffers of graphs[i] (a CUDA graph of the segmented forward)."""
        if not steps:
            raise ValueError("a segmented forward needs at least one step")
        bounds = (0, *accumulate(s.input_ids.numel() for s in steps))
        if graphs is None:
            return SegmentPlans(bounds, tuple(self.inner.plan(s) for s in steps))
        return SegmentPlans(bounds, tuple(self.inner.plan(s, g) for s, g in zip(steps, graphs)))

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Each segment's queries through the wrapped backend, with that segment's tokens,
        positions and slots (a backend may read them), into one output in row order."""
        from flashrec_core.layers.batch import ForwardBatch

        plan: SegmentPlans = batch.attn_metadata
        outs = []
        for (lo, hi), segment_plan in zip(pairwise(plan.bounds), plan.plans):
            part = ForwardBatch(
                batch.input_ids[lo:hi], batch.positions[lo:hi], batch.out_cache_loc[lo:hi],
                batch.kv_pool, self.inner, segment_plan,
            )  # fmt: skip
            part_kv = None if new_kv is None else (new_kv[0][lo:hi], new_kv[1][lo:hi])
            outs.append(self.inner.forward(q[lo:hi], layer_id, scale, part, part_kv))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
