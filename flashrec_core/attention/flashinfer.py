"""FlashInfer paged attention over the token-slot pool (page size 1), with cascade for beams.

One plan per step (outside the layers), reused by every layer:

| step                                   | kernels                                              |
| -------------------------------------- | ---------------------------------------------------- |
| prefill (several queries per sequence) | BatchPrefillWithPagedKVCacheWrapper, causal          |
| decode, flat                           | BatchDecodeWithPagedKVCacheWrapper (tensor cores)    |
| beam decode with a shared prompt       | prefix: BatchPrefill, non-causal, one "sequence" per |
|                                        | request whose queries are its beam rows; suffix:     |
|                                        | BatchDecode over each beam's own few slots; then     |
|                                        | merge_state_in_place of the two softmax states       |

The cascade reads each request's prompt KV once for all its beams. Its suffix level goes through
the decode kernel, not a second prefill: a beam has 1..depth-1 suffix slots and thousands of beams
share a step, which the prefill kernel (a query tile per sequence) handles an order of magnitude
slower (measured on an H200: 2.0 ms vs 0.35 ms per layer at 8,000 beams).

CUDA graphs: `graph_attention(num_requests, num_rows)` returns wrappers built in FlashInfer's
CUDA-graph mode over fixed index buffers; `plan(step, graph=...)` fills them before a replay.
`prefill_graph_attention(num_sequences, max_tokens)` does the same for a prompt prefill of a
fixed sequence count (engine/prefill_graph.py pads prefills to it).

Per-layer specs (contract v2): each distinct `AttentionSpec` (a `LayerGroups` group) gets its own
wrappers, planned once per step with its scale, `logits_soft_cap` and `window_left = W - 1`
(FlashInfer's window counts the keys left of the query). A windowed group's cascade prefix gets
only the prompt slots inside the window (`window_shared_prefix`): the prefix level is
non-causal, so a window there would be measured from the wrong query position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashrec_core.attention.base import LayerGroups, graph_index_buffers, window_shared_prefix
from flashrec_core.attention.step import StepInput
from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.layers.batch import ForwardBatch

MIN_WORKSPACE_BYTES = 256 << 20
WORKSPACE_BYTES_PER_ROW = 256 << 10
"""Split-KV scratch grows with the beam rows of a step: CUDA-graph-mode plans (grid padded for
the largest plan) asked for 1.2 GB at 8,000 rows on an H200, ~150 KB a row; 256 KB a row leaves
room (2 GiB per workspace at the default 8,192 rows)."""


@dataclass(frozen=True)
class FlashInferMetadata:
    kind: str  # "prefill" | "decode" | "cascade"
    wrapper: Any  # prefill / flat decode wrapper; the prefix wrapper of a cascade
    suffix: Any = None  # cascade: the per-beam decode wrapper


@dataclass(frozen=True)
class GroupedMetadata:
    """One plan per layer group; layer i runs `per_group[groups.group(i)]`."""

    per_group: tuple[FlashInferMetadata, ...]


@dataclass(frozen=True)
class GraphWrappers:
    """One layer group's wrappers in CUDA-graph mode for one captured shape."""

    prefix: Any  # BatchPrefill over the prompts (cascade)
    suffix: Any  # BatchDecode over each beam's own slots (cascade)
    flat: Any  # BatchDecode over prompt + own slots per beam (cascade off)


@dataclass(frozen=True)
class GraphAttention:
    """Wrappers in CUDA-graph mode for one captured shape: `num_requests` prompts shared by
    `num_rows` beams, per layer group. Their index buffers are fixed; each replay re-plans
    into them."""

    num_requests: int
    num_rows: int
    per_group: tuple[GraphWrappers, ...]


@dataclass(frozen=True)
class PrefillGraphAttention:
    """Graph-mode prefill wrappers (one per layer group) for `num_sequences` sequences of up to
    `max_tokens` tokens in all. They plan into the index buffers the cascade prefix graphs use
    (one graph replays at a time, and each plan is queued right before its replay)."""

    num_sequences: int
    max_tokens: int
    per_group: tuple[Any, ...]


class PlanGuard:
    """`plan(wrapper, ...)`: wrapper.plan, safe to call again before the GPU reached the last
    plan's copy.

    A plan writes its schedule into a pinned host buffer and enqueues an async copy to the
    device. Steps plan without a host sync in between, so before re-planning a wrapper the host
    waits for its previous copy (an event right after it), not for the whole step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._planned: dict[int, torch.cuda.Event] = {}

    def plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event


@dataclass
class _Wrappers:
    """One layer group's eager wrappers (prefill, flat decode, cascade prefix and suffix)."""

    prefill: Any
    decode: Any
    prefix: Any
    suffix: Any


class FlashInferAttentionBackend:
    name = "flashinfer"
    supports_graphs = True
    supports_prefill_graphs = True
    head_dims = (64, 128, 256)
    """The head dims FlashInfer 0.6's prefill and decode kernels are built for; a model of
    another (the embedded demo model's 16) leaves every step to the Triton kernels
    (`TritonPrefillAttention` takes its one-query prefills too)."""

    def __init__(
        self,
        device: torch.device,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        cascade: bool = True,
        max_rows: int = 8192,
        max_requests: int = 1024,
        max_context: int = 16384,
        max_suffix: int = 8,
        layers: Sequence[AttentionSpec] = (),
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.device = device
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.cascade = cascade
        self.groups = LayerGroups.create(layers, head_dim**-0.5)
        self.tensor_cores = num_q_heads != num_kv_heads
        # NOTE: two float workspaces: the prefix and suffix kernels of one cascade layer run back
        # to back; every other wrapper (also in graph mode, and of every layer group) shares one
        # of them: they are split-KV scratch, used within one kernel run, one run at a time.
        size = max(MIN_WORKSPACE_BYTES, WORKSPACE_BYTES_PER_ROW * max_rows)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self.suffix_workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self.wrappers = [self._eager_wrappers() for _ in self.groups.specs]
        self.limits = (max_rows, max_requests, max_context, max_suffix)
        self._graph_buffers: list[dict[str, torch.Tensor]] | None = None
        self._guard = PlanGuard(device)

    def _eager_wrappers(self) -> _Wrappers:
        prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper
        return _Wrappers(
            prefill(self.workspace, "NHD"), self._decode_wrapper(self.workspace),
            prefill(self.workspace, "NHD"), self._decode_wrapper(self.suffix_workspace),
        )  # fmt: skip

    def _decode_wrapper(self, workspace: torch.Tensor, **graph: Any) -> Any:
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.tensor_cores, **graph
        )

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        self._guard.plan(wrapper, *args, **kwargs)

    def _common(self, spec: AttentionSpec, windowed: bool = True) -> dict[str, Any]:
        window = spec.sliding_window if windowed else None
        return dict(
            q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=spec.scale,
            logits_soft_cap=spec.logit_softcap, window_left=-1 if window is None else window - 1,
        )  # fmt: skip

    def plan(
        self, step: StepInput, graph: GraphAttention | PrefillGraphAttention | None = None
    ) -> GroupedMetadata:
        """One plan per layer group (see `_plan_group`)."""
        if isinstance(graph, PrefillGraphAttention):
            return GroupedMetadata(
                tuple(self._plan_prefill(step, g, w) for g, w in enumerate(graph.per_group))
            )
        return GroupedMetadata(
            tuple(
                self._plan_group(step, g, None if graph is None else graph.per_group[g])
                for g in range(len(self.groups.specs))
            )
        )

    def _plan_group(
        self, step: StepInput, g: int, graph: GraphWrappers | None
    ) -> FlashInferMetadata:
        """Host index arrays (int64, CPU) stay on the host for the plan's scheduling; the beam
        suffix indices may live on the device (copied there without a sync)."""
        hq, hkv, d = self.shape
        spec, eager = self.groups.specs[g], self.wrappers[g]
        num_seq = step.qo_indptr.numel() - 1
        one_query_each = step.input_ids.numel() == num_seq
        sp = step.shared_prefix
        if self.cascade and sp is not None:
            prefix = graph.prefix if graph is not None else eager.prefix
            suffix = graph.suffix if graph is not None else eager.suffix
            sp = window_shared_prefix(sp, spec.sliding_window)
            num_req = sp.prefix_qo_indptr.numel() - 1
            self._plan(
                prefix,
                _i32(sp.prefix_qo_indptr), _i32(sp.prefix_kv_indptr),
                _i32(sp.prefix_kv_indices, self.device), _ones(num_req), hq, hkv, d, 1,
                causal=False, **self._common(spec, windowed=False),
            )  # fmt: skip
            # the suffix (a beam's own slots, fewer than the window) is never windowed
            self._plan(
                suffix,
                _i32(sp.suffix_kv_indptr), _i32(sp.suffix_kv_indices, self.device),
                _ones(num_seq), hq, hkv, d, 1, **self._common(spec, windowed=False),
            )  # fmt: skip
            return FlashInferMetadata("cascade", prefix, suffix)
        if one_query_each:
            flat = graph.flat if graph is not None else eager.decode
            self._plan(
                flat,
                _i32(step.kv_indptr), _i32(step.flat_kv_indices(), self.device), _ones(num_seq),
                hq, hkv, d, 1, **self._common(spec),
            )  # fmt: skip
            return FlashInferMetadata("decode", flat)
        assert graph is None, "prefill graphs plan through PrefillGraphAttention"
        return self._plan_prefill(step, g, eager.prefill)

    def _plan_prefill(self, step: StepInput, g: int, wrapper: Any) -> FlashInferMetadata:
        # Never disable_split_kv: FlashInfer 0.6.13's graph-mode FA2 prefill then launches its
        # padded grid without the mask of valid blocks, and the spare blocks read plan entries
        # a previous plan left in the workspace (upstream PR flashinfer-ai/flashinfer#5176, open;
        # an illegal memory access on an H100 for 16 new tokens over 8,192 cached ones,
        # docs/benchmarks.md session 21). With split-KV on, the mask exists.
        hq, hkv, d = self.shape
        self._plan(
            wrapper,
            _i32(step.qo_indptr), _i32(step.kv_indptr),
            _i32(step.flat_kv_indices(), self.device), _ones(step.qo_indptr.numel() - 1),
            hq, hkv, d, 1, causal=True, **self._common(self.groups.specs[g]),
        )  # fmt: skip
        return FlashInferMetadata("prefill", wrapper)

    def prefill_graph_attention(self, num_sequences: int, max_tokens: int) -> PrefillGraphAttention:
        """Graph-mode prefill wrappers for `num_sequences` sequences, sized by one plan of
        `max_tokens` pad tokens: FlashInfer fixes a graph-mode wrapper's launch grid at its first
        plan, so every later plan of up to `max_tokens` tokens fits the kernels it captured."""
        _, max_requests, max_context, _ = self.limits
        if max_tokens > max(max_requests * max_context, 1):
            raise ValueError(f"{max_tokens} prefill tokens exceed the index buffer")
        fi, b = self._fi, num_sequences
        wrappers = tuple(
            fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=buf["prefix_qo"][: b + 1],
                paged_kv_indptr_buf=buf["prefix_kv"][: b + 1],
                paged_kv_indices_buf=buf["prefix_idx"],
                paged_kv_last_page_len_buf=buf["ones"][:b],
            )  # fmt: skip
            for buf in self._buffers()
        )
        graph = PrefillGraphAttention(num_sequences, max_tokens, wrappers)
        ptr = torch.arange(b + 1, dtype=torch.int64)
        ptr[-1] = max_tokens  # b - 1 one-token sequences, the last takes the rest
        sizing = StepInput(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64),
            positions=torch.zeros(max_tokens, dtype=torch.int64),
            out_cache_loc=torch.zeros(max_tokens, dtype=torch.int64),
            qo_indptr=ptr, kv_indptr=ptr, kv_indices=torch.zeros(max_tokens, dtype=torch.int64),
        )  # fmt: skip
        self.plan(sizing, graph=graph)
        return graph

    def graph_attention(self, num_requests: int, num_rows: int) -> GraphAttention:
        """CUDA-graph-mode wrappers for one shape, per layer group. Index buffers are views of
        one set of buffers per group, sized for the largest shape (one graph replays at a time;
        the groups are all planned before it)."""
        max_rows, max_requests, max_context, max_suffix = self.limits
        if num_rows > max_rows or num_requests > max(max_requests, max_rows):
            raise ValueError(f"graph shape {num_requests} requests / {num_rows} rows over limits")
        per_group = tuple(
            self._graph_wrappers(buf, num_requests, num_rows) for buf in self._buffers()
        )
        return GraphAttention(num_requests, num_rows, per_group)

    def _graph_wrappers(
        self, buf: dict[str, torch.Tensor], num_requests: int, num_rows: int
    ) -> GraphWrappers:
        fi = self._fi
        prefix = fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=buf["prefix_qo"][: num_requests + 1],
            paged_kv_indptr_buf=buf["prefix_kv"][: num_requests + 1],
            paged_kv_indices_buf=buf["prefix_idx"],
            paged_kv_last_page_len_buf=buf["ones"][:num_requests],
        )  # fmt: skip

        def per_row(workspace: torch.Tensor, indices: str) -> Any:
            return self._decode_wrapper(
                workspace, use_cuda_graph=True,
                paged_kv_indptr_buffer=buf["row_kv"][: num_rows + 1],
                paged_kv_indices_buffer=buf[indices],
                paged_kv_last_page_len_buffer=buf["ones"][:num_rows],
            )  # fmt: skip

        suffix = per_row(self.suffix_workspace, "suffix_idx")
        flat = per_row(self.workspace, "flat_idx")
        return GraphWrappers(prefix, suffix, flat)

    def _buffers(self) -> list[dict[str, torch.Tensor]]:
        if self._graph_buffers is None:
            self._graph_buffers = [self._group_buffers() for _ in self.groups.specs]
        return self._graph_buffers

    def _group_buffers(self) -> dict[str, torch.Tensor]:
        max_rows, max_requests, max_context, max_suffix = self.limits
        reqs = max(max_requests, max_rows)
        flat_len = max_rows * (max_context + max_suffix) if not self.cascade else 1
        buffers = graph_index_buffers(
            self.device, prefix_qo=reqs + 1, prefix_kv=reqs + 1,
            prefix_idx=max(max_requests * max_context, 1), row_kv=max_rows + 1,
            suffix_idx=max_rows * max_suffix, flat_idx=flat_len,
        )  # fmt: skip
        buffers["ones"] = torch.ones(reqs, dtype=torch.int32, device=self.device)
        return buffers

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        spec = self.groups.spec(layer_id)
        assert abs(scale - spec.scale) <= 1e-6 * spec.scale, (
            f"layer {layer_id} attends with scale {scale}, its plan with {spec.scale}: the "
            "model's Attention spec and ModelConfig.attention disagree"
        )
        meta = batch.attn_metadata.per_group[self.groups.group(layer_id)]
        pool = batch.kv_pool
        # NOTE: [num_slots, Hkv, D] viewed as pages of one token: [num_slots, 1, Hkv, D].
        kv = (pool.k_cache[layer_id].unsqueeze(1), pool.v_cache[layer_id].unsqueeze(1))
        # q is a strided view of the qkv projection. The prefill kernel takes its strides (the
        # whole prompt's q is not copied); the decode kernels get a contiguous copy (one row per
        # sequence, cheap), since no test covers them with a strided q.
        if meta.kind == "decode":
            return meta.wrapper.run(q.contiguous(), kv)
        if meta.kind != "cascade":
            return meta.wrapper.run(q, kv)
        out, lse = meta.wrapper.run(q, kv, return_lse=True)
        out_suffix, lse_suffix = meta.suffix.run(q.contiguous(), kv, return_lse=True)
        self._fi.merge_state_in_place(out, lse, out_suffix, lse_suffix)
        return out


def _i32(x: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """int32 copy for FlashInfer: host arrays stay on the host (the plan reads them there without
    a device sync); index lists move to `device` when given."""
    x = x.to(torch.int32)
    return x.to(device, non_blocking=True) if device is not None else x


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.int32)
