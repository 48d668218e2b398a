"""Beam steps through one Triton kernel per layer; every other step through the wrapped backend.

A beam decode step's attention is two-level: each request's prompt slots (shared by its beams)
and each beam's own 1..depth-1 slots. FlashInfer runs it as a cascade of two kernels and a merge;
on an H200 its prefix level ran at ~32 TFLOP/s (2.1 ms per layer at 8,000 beams, the largest
cost of a decode step). `flashrec_kernels.beam_cascade_attention` does both levels in one pass,
packing the GQA group into the query tile so that each prompt K/V chunk serves every beam and
head that shares it.

Selected by `EngineConfig.beam_attention` ("auto" picks it on CUDA where it applies, see
`config.resolve_engine_config`). On an H200 it runs a 160-request x 50-beam step in 0.55 ms
per layer (docs/benchmarks.md); tests/gpu checks it against fp32 transformers, graphs and eager.

Per-layer specs: the kernel applies a layer's logit soft-cap itself; a sliding window is a
shorter prompt level (`window_shared_prefix`), so each layer group gets its own index set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashrec_core.attention.base import (
    BackendWrapper,
    LayerGroups,
    graph_index_buffers,
    window_shared_prefix,
)
from flashrec_core.attention.step import dense_suffix
from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.attention.base import AttentionBackend
    from flashrec_core.attention.step import SharedPrefix, StepInput
    from flashrec_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class BeamKernelMetadata:
    """Device int32 index tensors of one beam step for one layer group, in the kernel's layout."""

    prefix_indptr: torch.Tensor  # [B + 1]
    prefix_indices: torch.Tensor  # [sum of (windowed) prompt lengths]
    row_indptr: torch.Tensor  # [B + 1]
    suffix: torch.Tensor  # [R, S]
    max_rows_per_request: int


@dataclass(frozen=True)
class BeamKernelPlan:
    """A beam step's plan: one index set per layer group."""

    per_group: tuple[BeamKernelMetadata, ...]


@dataclass(frozen=True)
class BeamKernelGraph:
    """One captured shape: views of the backend's fixed index buffers, one set per layer group
    (one graph replays at a time, so every shape shares them)."""

    num_requests: int
    num_rows: int
    buffers: tuple[dict[str, torch.Tensor], ...]
    suffix_width: int | None = None
    """Own-slot columns the captured kernel reads (rows with fewer pad with -1): a merged
    step's graph serves waves at every level. None: the captured step's own (uniform) count."""


class TritonBeamAttention(BackendWrapper):
    """Wraps a backend: shared-prefix steps go to the Triton kernel, the rest to `inner`."""

    plan_type = BeamKernelPlan

    def __init__(self, inner: AttentionBackend, device: torch.device, max_rows: int,
                 max_prompt_slots: int, max_suffix: int = 8,
                 layers: Sequence[AttentionSpec] = (), head_dim: int = 128,
                 fp8_scores: bool = False) -> None:  # fmt: skip
        """fp8_scores: `EngineConfig.fp8_attention_scores` (the kernel's experimental FP8
        score dot)."""
        self.inner = inner
        self.fp8_scores = fp8_scores
        self.name = f"{inner.name}+triton-beam"
        self.device = device
        self.supports_graphs = device.type == "cuda"
        self.supports_prefill_graphs = getattr(inner, "supports_prefill_graphs", False)
        self.head_dims: tuple[int, ...] | None = getattr(inner, "head_dims", None)
        """The wrapped backend's (the steps this wrapper passes on run there)."""
        self.groups = LayerGroups.create(layers, head_dim**-0.5)
        self.limits = (max_rows, max_prompt_slots, max_suffix)
        self._graph_buffers: tuple[dict[str, torch.Tensor], ...] | None = None

    def plan(self, step: StepInput, graph: Any = None) -> Any:
        """Beam steps plan for the kernel (`graph`: a `BeamKernelGraph`); every other step,
        prefill graphs included, plans in the wrapped backend."""
        sp = step.shared_prefix
        if sp is None:
            return self.inner.plan(step) if graph is None else self.inner.plan(step, graph)
        width = graph.suffix_width if graph is not None else None  # None: the widest row's
        suffix = dense_suffix(sp, width).to(self.device, torch.int32)  # shared by the groups
        return BeamKernelPlan(
            tuple(
                self._plan_group(
                    window_shared_prefix(sp, spec.sliding_window),
                    suffix,
                    None if graph is None else graph.buffers[g],
                    graph,
                )  # fmt: skip
                for g, spec in enumerate(self.groups.specs)
            )
        )

    def _plan_group(
        self, sp: SharedPrefix, suffix: torch.Tensor,
        buf: dict[str, torch.Tensor] | None, graph: BeamKernelGraph | None,
    ) -> BeamKernelMetadata:  # fmt: skip
        dev = self.device
        rows, suffix_len = suffix.shape
        parts = {
            "prefix_indptr": sp.prefix_kv_indptr.to(torch.int32),
            "prefix_indices": sp.prefix_kv_indices.to(dev, torch.int32),
            "row_indptr": sp.prefix_qo_indptr.to(torch.int32),
            "suffix": suffix.flatten(),
        }
        if buf is None or graph is None:
            widths = sp.prefix_qo_indptr[1:] - sp.prefix_qo_indptr[:-1]  # host: no device sync
            return BeamKernelMetadata(
                parts["prefix_indptr"].to(dev, non_blocking=True),
                parts["prefix_indices"],
                parts["row_indptr"].to(dev, non_blocking=True),
                parts["suffix"].view(rows, suffix_len),
                int(widths.max()),
            )
        # Graph: copy into the fixed buffers the captured kernel reads.
        for name, value in parts.items():
            buf[name][: value.numel()].copy_(value, non_blocking=True)
        return BeamKernelMetadata(
            buf["prefix_indptr"][: graph.num_requests + 1],
            buf["prefix_indices"],
            buf["row_indptr"][: graph.num_requests + 1],
            buf["suffix"][: rows * suffix_len].view(rows, suffix_len),
            graph.num_rows // graph.num_requests,
        )

    def graph_attention(  # type: ignore[override]  # it owns the beam-step graphs
        self, num_requests: int, num_rows: int, suffix_width: int | None = None
    ) -> BeamKernelGraph:
        max_rows, max_prompt_slots, max_suffix = self.limits
        if self._graph_buffers is None:
            self._graph_buffers = tuple(
                graph_index_buffers(
                    self.device,
                    prefix_indptr=max_rows + 1,
                    prefix_indices=max_prompt_slots,
                    row_indptr=max_rows + 1,
                    suffix=max_rows * max_suffix,
                )  # fmt: skip
                for _ in self.groups.specs
            )
        return BeamKernelGraph(num_requests, num_rows, self._graph_buffers, suffix_width)

    def prefill_graph_attention(self, num_sequences: int, max_tokens: int) -> Any:
        """Prefill runs in the wrapped backend, so do its graphs."""
        return self.inner.prefill_graph_attention(num_sequences, max_tokens)

    def attend(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        plan: BeamKernelPlan, new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        from flashrec_kernels import beam_cascade_attention

        meta = plan.per_group[self.groups.group(layer_id)]
        pool = batch.kv_pool
        out = beam_cascade_attention(
            q.to(torch.bfloat16), pool.k_cache[layer_id], pool.v_cache[layer_id],
            meta.prefix_indptr, meta.prefix_indices, meta.row_indptr, meta.suffix, scale,
            meta.max_rows_per_request, logit_softcap=self.groups.spec(layer_id).logit_softcap,
            fp8_scores=self.fp8_scores,
        )  # fmt: skip
        return out.to(q.dtype)
