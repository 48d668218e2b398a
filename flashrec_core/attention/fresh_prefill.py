"""Prompt prefills over the keys and values they just computed (`--prefill-attention fresh`,
`auto`'s choice on sm90 with FlashInfer).

Why: the paged prefill reads a prompt's own keys back from the cache, FP8 there. On sm90 that
leaves FlashInfer 0.6.13 its FA2 kernel (its FA3 path takes an FP8 cache only with FP8
queries) and our Triton kernel at about 217 TFLOP/s. But a prompt's own keys and values exist
in the model's dtype before they are stored. This wrapper attends over those with FlashInfer's
ragged prefill, FA3 on sm90. On an H100, eight 960-token prompts after a 64-token prefix took
95 us of FA3 per layer against 158 us for the Triton kernel (docs/benchmarks.md, session 37).

Layout: sequence b's keys are rows kv_indptr[b] .. kv_indptr[b + 1] of two buffers [N, Hkv, D]
in the model's dtype, in the order of its slots: first its cached context (a prefix-cache hit,
an earlier chunk of the prompt), copied from the pool and converted (`copy_kv_rows`, one
launch), then its own new tokens: written by the fused RoPE kernel as it stores them
(`claim_kv_mirror`), else copied from the layer's K/V here. A step without context attends over
the layer's K/V directly (strided views of the qkv projection), with no copy at all.

Numerics: a prompt's own keys and values enter its attention unrounded, as in transformers;
its context enters as the cache holds it, and beam steps read the cache as before. With a bf16
cache the result is the paged prefill's up to summation order.

Which steps: prompt prefills (several queries per sequence, no shared prefix), when their
context rows are at most their new tokens. Copying a long context costs more than reading it in
place, so a few tokens after a long cached prompt go to the wrapped backend (the Triton prefill
kernel or the backend's own), as do beam steps. A prefill graph holds at most as many context
rows as its token bucket (`fits_prefill_graph`); a step with more replays the wrapped
backend's graph of that shape, captured on first use.

Off the GPU (tests, CPU serving) the same layout and copies feed the torch reference's attention
(`TorchAttentionBackend.attend`), so CPU tests check everything but the FlashInfer call itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flashrec_core.attention.base import (
    BackendWrapper,
    LayerGroups,
    check_prefill_graph_room,
    graph_index_buffers,
)
from flashrec_core.attention.step import StepInput
from flashrec_core.attention.torch_ref import TorchAttentionBackend
from flashrec_core.kvcache.pool import KVPool
from flashrec_core.spec import AttentionSpec
from flashrec_kernels import copy_kv_rows, copy_kv_rows_ref

if TYPE_CHECKING:
    from flashrec_core.attention.base import AttentionBackend
    from flashrec_core.layers.batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20
"""FlashInfer's float workspace for the ragged prefill (split-KV scratch)."""
HEAD_DIMS = (64, 128, 256)
"""The head dims FlashInfer's ragged prefill kernels are built for."""


@dataclass(frozen=True)
class FreshLayout:
    """Where a prefill step's keys go in the buffers (host int64 arrays)."""

    own_rows: np.ndarray  # [T]: the row of each new token
    context_rows: np.ndarray  # [C]: the rows of the cached context
    context_slots: np.ndarray  # [C]: the pool slot each of them is copied from
    num_rows: int  # rows the attention reads: the step's kv_indptr[-1]

    @classmethod
    def of(cls, step: StepInput) -> FreshLayout:
        """Vectorized over sequences (numpy): a prefill's host work runs before its launch."""
        qo = step.qo_indptr.numpy().astype(np.int64)
        kv = step.kv_indptr.numpy().astype(np.int64)
        new, keys = np.diff(qo), np.diff(kv)
        context = keys - new
        if (context < 0).any():
            b = int(np.argmax(context < 0))
            raise ValueError(f"sequence {b} has {new[b]} new tokens but only {keys[b]} keys")
        seq = np.repeat(np.arange(new.size), new)
        own = np.arange(int(qo[-1]), dtype=np.int64) - qo[seq] + kv[seq] + context[seq]
        ctx_seq = np.repeat(np.arange(new.size), context)
        ctx_start = np.cumsum(context) - context
        offset = np.arange(int(context.sum()), dtype=np.int64) - ctx_start[ctx_seq]
        rows = kv[ctx_seq] + offset
        slots = step.flat_kv_indices().numpy().astype(np.int64)[rows]
        return cls(own, rows, slots, int(kv[-1]))


@dataclass(frozen=True)
class FreshPrefillPlan:
    """A prefill step planned for this wrapper: device index tensors, the buffers, and the
    attention's plan (FlashInfer wrappers per layer group, or the torch reference's metadata)."""

    own_rows: torch.Tensor  # [T] int64
    context_rows: torch.Tensor  # [C] int64 (graphs: padded to the shape's tokens, spare row)
    context_slots: torch.Tensor  # [C] int64 (graphs: padded with the pad slot)
    context_count: torch.Tensor | None  # graphs with the Triton copy: [1], the real C
    buffers: tuple[torch.Tensor, torch.Tensor] | None  # K, V; None: attend over the layer's K/V
    per_group: tuple[Any, ...]  # planned FlashInfer wrappers, one per layer group (CUDA)
    torch_meta: Any  # TorchAttentionMetadata over the buffers' rows (off CUDA)
    mirrored: set[int] = field(default_factory=set)
    """Layers whose own rows the fused RoPE kernel wrote (`claim_kv_mirror`): no copy here."""


@dataclass(frozen=True)
class FreshPrefillGraph:
    """One captured prefill shape's FlashInfer wrappers (CUDA-graph mode), one per layer group."""

    num_sequences: int
    max_tokens: int
    per_group: tuple[Any, ...]


class FreshPrefillAttention(BackendWrapper):
    """Wraps a backend: prompt prefills attend over their fresh keys, the rest go to `inner`."""

    plan_type = FreshPrefillPlan

    def __init__(self, inner: AttentionBackend, device: torch.device, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_graph: tuple[int, int] = (0, 0), layers: Sequence[AttentionSpec] = (),
                 triton_copies: bool = False) -> None:  # fmt: skip
        """dtype: the model's (the layers' K/V); max_graph: (tokens, sequences) of the largest
        prefill graph the engine captures; triton_copies: copy cached context (and own rows the
        RoPE kernel did not write) with the one-launch Triton kernel
        (`flashrec_kernels.copy_kv_rows`), else its torch reference."""
        self.inner = inner
        self.name = f"{inner.name}+fresh-prefill"
        self.device = device
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.groups = LayerGroups.create(layers, head_dim**-0.5)
        self.supports_graphs = getattr(inner, "supports_graphs", False)
        self.supports_prefill_graphs = device.type == "cuda"
        self.max_graph = max_graph
        self._graph_state: dict[str, torch.Tensor] | None = None
        self._triton_copies = triton_copies
        self._copy = copy_kv_rows if triton_copies else copy_kv_rows_ref
        self.prefills: Counter[str] = Counter()
        """Prefill plans by path: "fresh" (own keys only), "with context", "wrapped" (left to
        `inner`, eagerly or in its graph: more context than new tokens, or than a fresh graph
        has rows for); and "mirrored": plans with context whose own rows the fused RoPE kernel
        wrote (`claim_kv_mirror`)."""
        if device.type == "cuda":
            import flashinfer

            from flashrec_core.attention.flashinfer import PlanGuard

            if head_dim not in HEAD_DIMS:
                raise ValueError(
                    f"--prefill-attention fresh runs FlashInfer's ragged prefill, built for head "
                    f"dims {HEAD_DIMS}; this model's is {head_dim}: use --prefill-attention auto"
                )
            self._fi = flashinfer
            self._guard = PlanGuard(device)
            sm90 = torch.cuda.get_device_capability(device)[0] == 9
            self.kernel = "fa3" if sm90 else "fa2"
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._eager = tuple(self._wrapper() for _ in self.groups.specs)
        else:
            self._torch = TorchAttentionBackend(device, layers=layers)

    def _wrapper(self, **graph: Any) -> Any:
        return self._fi.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", backend=self.kernel, **graph
        )

    def plan(self, step: StepInput, graph: Any = None) -> Any:
        """Prefill steps worth it (see the module docstring) plan here, into `graph`'s buffers
        when given; every other step plans in the wrapped backend (a prefill with more context
        than a fresh graph has rows for, into the wrapped backend's graph of its shape)."""
        if isinstance(graph, FreshPrefillGraph):
            return self._plan(step, FreshLayout.of(step), graph)
        if step.is_prompt_prefill():
            if graph is None:
                layout = FreshLayout.of(step)
                if layout.context_rows.size <= layout.own_rows.size:
                    return self._plan(step, layout, None)
            self.prefills["wrapped"] += 1
        return self.inner.plan(step) if graph is None else self.inner.plan(step, graph)

    def fits_prefill_graph(self, step: StepInput, tokens: int) -> bool:
        """Whether a padded prefill step replays a graph of `tokens` tokens: its context rows
        fit the graph's room for them (as many as its tokens)."""
        return int(step.kv_indptr[-1]) - step.input_ids.numel() <= tokens

    def _plan(
        self, step: StepInput, layout: FreshLayout, graph: FreshPrefillGraph | None
    ) -> FreshPrefillPlan:
        self.prefills["with context" if layout.context_rows.size else "fresh"] += 1
        own, rows, slots = (torch.from_numpy(a) for a in (
            layout.own_rows, layout.context_rows, layout.context_slots,
        ))  # fmt: skip
        if graph is not None:
            state = self._graph_buffers(graph)
            spare = state["k"].shape[0] - 1  # no sequence's keys: padded context goes there
            room = graph.max_tokens  # this shape's room for context, as fits_prefill_graph says
            if rows.numel() > room:
                raise ValueError(
                    f"{rows.numel()} context rows exceed the prefill graph's {room} "
                    "(check fits_prefill_graph before replaying)"
                )
            state["own_rows"][: own.numel()].copy_(own, non_blocking=True)
            # The Triton copy stops at the count; the torch one copies the padding to the spare row.
            state["context_rows"][:room].copy_(_padded(rows, room, spare), non_blocking=True)
            padded_slots = _padded(slots, room, KVPool.PAD_SLOT)
            state["context_slots"][:room].copy_(padded_slots, non_blocking=True)
            state["context_count"].fill_(rows.numel())
            buffers = (state["k"], state["v"])
            own, rows, slots = (
                state["own_rows"][: own.numel()],
                state["context_rows"][:room],
                state["context_slots"][:room],
            )
            count = state["context_count"] if self._triton_copies else None
        else:
            own, rows, slots = (t.to(self.device, non_blocking=True) for t in (own, rows, slots))
            buffers, count = None, None
            if layout.context_rows.size:
                size = (layout.num_rows, *self.shape[1:])
                buffers = (
                    torch.empty(size, dtype=self.dtype, device=self.device),
                    torch.empty(size, dtype=self.dtype, device=self.device),
                )
        if self.device.type != "cuda":
            rows_step = StepInput(
                step.input_ids, step.positions, step.out_cache_loc, step.qo_indptr,
                step.kv_indptr, torch.arange(layout.num_rows),
            )  # fmt: skip
            return FreshPrefillPlan(
                own, rows, slots, count, buffers, (), self._torch.plan(rows_step)
            )
        wrappers = self._eager if graph is None else graph.per_group
        for spec, wrapper in zip(self.groups.specs, wrappers):
            self._plan_wrapper(wrapper, step.qo_indptr, step.kv_indptr, spec)
        return FreshPrefillPlan(own, rows, slots, count, buffers, tuple(wrappers), None)

    def _plan_wrapper(
        self, wrapper: Any, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, spec: AttentionSpec
    ) -> None:
        hq, hkv, d = self.shape
        window = spec.sliding_window
        self._guard.plan(
            wrapper, qo_indptr.to(torch.int32), kv_indptr.to(torch.int32), hq, hkv, d,
            causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=spec.scale,
            logits_soft_cap=spec.logit_softcap, window_left=-1 if window is None else window - 1,
        )  # fmt: skip

    def prefill_graph_attention(
        self, num_sequences: int, max_tokens: int, wrapped: bool = False
    ) -> Any:
        """Graph-mode wrappers for `num_sequences` sequences, sized by a plan of `max_tokens`
        tokens and as many context rows (a graph-mode plan fixes the launch grid). wrapped: the
        wrapped backend's graph state instead, for the steps that do not fit this path's
        (`fits_prefill_graph`), which `plan` then hands to it."""
        if wrapped:
            if not hasattr(self.inner, "prefill_graph_attention"):
                raise ValueError(f"the {self.inner.name} attention backend cannot capture prefills")
            return self.inner.prefill_graph_attention(num_sequences, max_tokens)
        state = self._graph_buffers(FreshPrefillGraph(num_sequences, max_tokens, ()))
        b = num_sequences
        per_group = tuple(
            self._wrapper(
                use_cuda_graph=True,
                qo_indptr_buf=state["qo_indptr"][: b + 1],
                kv_indptr_buf=state["kv_indptr"][: b + 1],
            )  # fmt: skip
            for _ in self.groups.specs
        )
        qo = torch.arange(b + 1, dtype=torch.int64)
        qo[-1] = max_tokens  # b - 1 one-token sequences, the last takes the rest
        kv = qo.clone()
        kv[-1] += max_tokens  # and the most context a replay may bring
        for spec, wrapper in zip(self.groups.specs, per_group):
            self._plan_wrapper(wrapper, qo, kv, spec)
        return FreshPrefillGraph(num_sequences, max_tokens, per_group)

    def _graph_buffers(self, graph: FreshPrefillGraph) -> dict[str, torch.Tensor]:
        """The fixed buffers every prefill graph replays over, allocated once for the largest
        (`max_graph`): room for its tokens and as many context rows, plus a spare row."""
        check_prefill_graph_room(
            self.max_graph, graph.num_sequences, graph.max_tokens, "fresh-prefill"
        )
        tokens, sequences = self.max_graph
        if self._graph_state is None:
            size, dev = (2 * tokens + 1, *self.shape[1:]), self.device
            self._graph_state = {
                "k": torch.zeros(size, dtype=self.dtype, device=dev),
                "v": torch.zeros(size, dtype=self.dtype, device=dev),
                **graph_index_buffers(
                    dev,
                    torch.int64,
                    own_rows=tokens,
                    context_rows=tokens,
                    context_slots=tokens,
                    context_count=1,
                ),
                **graph_index_buffers(dev, qo_indptr=sequences + 1, kv_indptr=sequences + 1),
            }
        return self._graph_state

    def claim_kv_mirror(
        self, batch: ForwardBatch, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The buffers and own rows of a prefill with context, for the fused RoPE kernel to
        write this layer's new K/V into as it stores them (one pass less than copying them
        here); None for every other step (mixed steps' batches hold a segmented plan)."""
        plan = batch.attn_metadata
        if not isinstance(plan, FreshPrefillPlan) or plan.buffers is None:
            return None
        if not plan.mirrored:
            self.prefills["mirrored"] += 1
        plan.mirrored.add(layer_id)
        return (*plan.buffers, plan.own_rows)

    def attend(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        plan: FreshPrefillPlan, new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        if new_kv is None:
            raise ValueError("a fresh prefill attends over the layer's new K/V: pass new_kv")
        k, v = new_kv
        if plan.buffers is None:  # no context: the layer's K/V are the keys, in order
            keys, values = k, v
        else:
            keys, values = plan.buffers
            if layer_id not in plan.mirrored:  # token i's K/V to own_rows[i]
                self._copy(k, v, None, keys, values, plan.own_rows)
            # exact: an FP8 cache holds plain casts, which bf16 / fp16 represent
            pool = batch.kv_pool
            self._copy(
                pool.k_cache[layer_id], pool.v_cache[layer_id], plan.context_slots, keys, values,
                plan.context_rows, plan.context_count,
            )  # fmt: skip
        if plan.torch_meta is not None:
            return self._torch.attend(q, keys, values, layer_id, scale, plan.torch_meta)
        wrapper = plan.per_group[self.groups.group(layer_id)]
        return wrapper.run(q.to(self.dtype), keys, values).to(q.dtype)


def _padded(values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    out = torch.full((size,), fill, dtype=torch.int64)
    out[: values.numel()] = values
    return out
