"""Prompt prefills through the Triton prefill kernel; every other step through the wrapped backend.

On sm90, FlashInfer 0.6.13 prefills bf16 queries over an FP8 cache with its FA2 kernel (its FA3
path needs FP8 queries) and, in graph mode, splits the KV and merges: on an H100 a fresh
1,024-token prompt of the bench preset's shape took 37 us of attention and 41 us of merge per
layer (docs/benchmarks.md). `flashrec_kernels.prefill_attention` packs the GQA group into its
query tiles and reads only the keys the causal mask shows; its inputs and numerics are the same
(bf16 queries, the pool's K/V, fp32 softmax), so a prompt's result does not depend on which
path prefilled it.

Selected by `EngineConfig.prefill_attention`. Wraps any backend, the Triton beam wrapper
included: steps with a `SharedPrefix` (beam steps) and one-query-per-sequence steps go to
`inner`, unless `inner` has no kernels for the model's head dim (`head_dims`, FlashInfer's:
the embedded model's 16), when this kernel takes the one-query steps too (a fully cached
prompt's last token, say). Per-layer specs: the kernel applies each layer's soft-cap and
sliding window itself, so one plan serves every layer group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashrec_core.attention.base import (
    BackendWrapper,
    LayerGroups,
    check_prefill_graph_room,
    graph_index_buffers,
)
from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.attention.base import AttentionBackend
    from flashrec_core.attention.step import StepInput
    from flashrec_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class PrefillKernelPlan:
    """A prefill's device int32 index tensors in the kernel's layout (flashrec_kernels/prefill_attention.py)."""

    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [sum of kv lens]
    tiles: torch.Tensor  # [N, 2] (sequence, first packed row), spare rows (-1, 0)


@dataclass(frozen=True)
class PrefillKernelGraph:
    """One captured prefill shape: `num_sequences` sequences of up to `max_tokens` new tokens,
    planned into views of the wrapper's fixed buffers (one graph replays at a time)."""

    num_sequences: int
    max_tokens: int
    num_tiles: int


class TritonPrefillAttention(BackendWrapper):
    """Wraps a backend: prompt prefills go to the Triton kernel, the rest to `inner`."""

    plan_type = PrefillKernelPlan

    def __init__(self, inner: AttentionBackend, device: torch.device, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, max_context: int,
                 max_graph: tuple[int, int] = (0, 0),
                 layers: Sequence[AttentionSpec] = ()) -> None:  # fmt: skip
        """max_graph: (tokens, sequences) of the largest prefill graph the engine captures."""
        from flashrec_kernels.prefill_attention import prefill_block_m

        self.inner = inner
        self.name = f"{inner.name}+triton-prefill"
        self.device = device
        inner_dims: tuple[int, ...] | None = getattr(inner, "head_dims", None)
        self.one_query = inner_dims is not None and head_dim not in inner_dims
        """Whether one-query-per-sequence steps come here too: `inner` cannot run them."""
        self.supports_graphs = getattr(inner, "supports_graphs", False)
        self.supports_prefill_graphs = device.type == "cuda"
        self.groups = LayerGroups.create(layers, head_dim**-0.5)
        self.group = num_q_heads // num_kv_heads
        self.block_m = prefill_block_m(head_dim)
        self.max_context = max_context
        self.max_graph = max_graph
        self._buffers: dict[str, torch.Tensor] | None = None

    def plan(self, step: StepInput, graph: Any = None) -> Any:
        """Prefill steps (several queries per sequence, no shared prefix) plan for the kernel,
        into `graph`'s buffers when given; every other step plans in the wrapped backend."""
        if isinstance(graph, PrefillKernelGraph):
            return self._plan(step, graph)
        if graph is None and (
            step.is_prompt_prefill() or (self.one_query and step.shared_prefix is None)
        ):
            return self._plan(step, None)
        return self.inner.plan(step) if graph is None else self.inner.plan(step, graph)

    def _plan(self, step: StepInput, graph: PrefillKernelGraph | None) -> PrefillKernelPlan:
        from flashrec_kernels.prefill_attention import prefill_tiles

        capacity = None if graph is None else graph.num_tiles
        parts = {
            "qo_indptr": step.qo_indptr.to(torch.int32),
            "kv_indptr": step.kv_indptr.to(torch.int32),
            "kv_indices": step.flat_kv_indices().to(torch.int32),
            "tiles": prefill_tiles(
                step.qo_indptr, step.kv_indptr, self.group, self.block_m, capacity
            ),
        }
        if graph is None:
            return PrefillKernelPlan(
                **{k: v.to(self.device, non_blocking=True) for k, v in parts.items()}
            )
        buf = self._graph_buffers(graph)
        for name, value in parts.items():
            buf[name][: value.numel()].copy_(value.flatten(), non_blocking=True)
        b = graph.num_sequences
        return PrefillKernelPlan(
            buf["qo_indptr"][: b + 1], buf["kv_indptr"][: b + 1], buf["kv_indices"],
            buf["tiles"][: 2 * graph.num_tiles].view(graph.num_tiles, 2),
        )  # fmt: skip

    def prefill_graph_attention(self, num_sequences: int, max_tokens: int) -> PrefillKernelGraph:
        """A prefill graph's shape; its tile map has room for any prefill that pads to it."""
        from flashrec_kernels.prefill_attention import prefill_tile_capacity

        tiles = prefill_tile_capacity(max_tokens, num_sequences, self.group, self.block_m)
        return PrefillKernelGraph(num_sequences, max_tokens, tiles)

    def _graph_buffers(self, graph: PrefillKernelGraph) -> dict[str, torch.Tensor]:
        """The fixed index buffers every prefill graph plans into, allocated once for the
        largest graph (`max_graph`): a captured kernel keeps their addresses, so they are never
        reallocated."""
        from flashrec_kernels.prefill_attention import prefill_tile_capacity

        check_prefill_graph_room(
            self.max_graph, graph.num_sequences, graph.max_tokens, "Triton prefill"
        )
        tokens, sequences = self.max_graph
        if self._buffers is None:
            self._buffers = graph_index_buffers(
                self.device, qo_indptr=sequences + 1, kv_indptr=sequences + 1,
                # each sequence's whole prompt, at most; pad sequences hold the spare tokens
                kv_indices=sequences * self.max_context + tokens,
                tiles=2 * prefill_tile_capacity(tokens, sequences, self.group, self.block_m),
            )  # fmt: skip
        return self._buffers

    def attend(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        plan: PrefillKernelPlan, new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        from flashrec_kernels import prefill_attention

        spec = self.groups.spec(layer_id)
        pool = batch.kv_pool
        out = prefill_attention(
            q.to(torch.bfloat16), pool.k_cache[layer_id], pool.v_cache[layer_id],
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.tiles, scale,
            logit_softcap=spec.logit_softcap, window=spec.sliding_window, block_m=self.block_m,
        )  # fmt: skip
        return out.to(q.dtype)
