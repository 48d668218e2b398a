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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashrec_core.attention.base import graph_index_buffers

if TYPE_CHECKING:
    from flashrec_core.engine.model_runner import StepInput
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
class GraphAttention:
    """Wrappers in CUDA-graph mode for one captured shape: `num_requests` prompts shared by
    `num_rows` beams. Their index buffers are fixed; each replay re-plans into them."""

    num_requests: int
    num_rows: int
    prefix: Any  # BatchPrefill over the prompts (cascade)
    suffix: Any  # BatchDecode over each beam's own slots (cascade)
    flat: Any  # BatchDecode over prompt + own slots per beam (cascade off)


class FlashInferAttentionBackend:
    name = "flashinfer"
    supports_graphs = True

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
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.device = device
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.cascade = cascade
        self.scale = head_dim**-0.5
        self.tensor_cores = num_q_heads != num_kv_heads
        # NOTE: two float workspaces: the prefix and suffix kernels of one cascade layer run back
        # to back; every other wrapper (also in graph mode) shares one of them, since one step
        # runs at a time on one stream.
        size = max(MIN_WORKSPACE_BYTES, WORKSPACE_BYTES_PER_ROW * max_rows)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self.suffix_workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = self._decode_wrapper(self.workspace)
        self.prefix = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.suffix = self._decode_wrapper(self.suffix_workspace)
        self.limits = (max_rows, max_requests, max_context, max_suffix)
        self._graph_buffers: dict[str, torch.Tensor] | None = None
        self._planned: dict[int, torch.cuda.Event] = {}

    def _decode_wrapper(self, workspace: torch.Tensor, **graph: Any) -> Any:
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.tensor_cores, **graph
        )

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """wrapper.plan, safe to call again before the GPU reached the last plan's copy.

        A plan writes its schedule into a pinned host buffer and enqueues an async copy to the
        device. Beam steps plan without a host sync in between, so before re-planning a wrapper
        the host waits for its previous copy (an event right after it), not for the whole step.
        """
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event

    def _common(self) -> dict[str, Any]:
        return dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.scale)

    def plan(self, step: StepInput, graph: GraphAttention | None = None) -> FlashInferMetadata:
        """Host index arrays (int64, CPU) stay on the host for the plan's scheduling; the beam
        suffix indices may live on the device (copied there without a sync)."""
        hq, hkv, d = self.shape
        num_seq = step.qo_indptr.numel() - 1
        one_query_each = step.input_ids.numel() == num_seq
        sp = step.shared_prefix
        if self.cascade and sp is not None:
            prefix = graph.prefix if graph is not None else self.prefix
            suffix = graph.suffix if graph is not None else self.suffix
            num_req = sp.prefix_qo_indptr.numel() - 1
            self._plan(
                prefix,
                _i32(sp.prefix_qo_indptr), _i32(sp.prefix_kv_indptr),
                _i32(sp.prefix_kv_indices, self.device), _ones(num_req), hq, hkv, d, 1,
                causal=False, **self._common(),
            )  # fmt: skip
            self._plan(
                suffix,
                _i32(sp.suffix_kv_indptr), _i32(sp.suffix_kv_indices, self.device),
                _ones(num_seq), hq, hkv, d, 1, **self._common(),
            )  # fmt: skip
            return FlashInferMetadata("cascade", prefix, suffix)
        if one_query_each:
            flat = graph.flat if graph is not None else self.decode
            self._plan(
                flat,
                _i32(step.kv_indptr), _i32(step.flat_kv_indices(), self.device), _ones(num_seq),
                hq, hkv, d, 1, **self._common(),
            )  # fmt: skip
            return FlashInferMetadata("decode", flat)
        assert graph is None, "prefill steps are never captured"
        self._plan(
            self.prefill,
            _i32(step.qo_indptr), _i32(step.kv_indptr),
            _i32(step.flat_kv_indices(), self.device), _ones(num_seq), hq, hkv, d, 1,
            causal=True, **self._common(),
        )  # fmt: skip
        return FlashInferMetadata("prefill", self.prefill)

    def graph_attention(self, num_requests: int, num_rows: int) -> GraphAttention:
        """CUDA-graph-mode wrappers for one shape. Index buffers are views of one set of
        backend-wide buffers sized for the largest shape (one graph replays at a time)."""
        max_rows, max_requests, max_context, max_suffix = self.limits
        if num_rows > max_rows or num_requests > max(max_requests, max_rows):
            raise ValueError(f"graph shape {num_requests} requests / {num_rows} rows over limits")
        buf = self._buffers()
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
        return GraphAttention(num_requests, num_rows, prefix, suffix, flat)

    def _buffers(self) -> dict[str, torch.Tensor]:
        if self._graph_buffers is None:
            max_rows, max_requests, max_context, max_suffix = self.limits
            reqs = max(max_requests, max_rows)
            flat_len = max_rows * (max_context + max_suffix) if not self.cascade else 1

            self._graph_buffers = graph_index_buffers(
                self.device, prefix_qo=reqs + 1, prefix_kv=reqs + 1,
                prefix_idx=max(max_requests * max_context, 1), row_kv=max_rows + 1,
                suffix_idx=max_rows * max_suffix, flat_idx=flat_len,
            )  # fmt: skip
            self._graph_buffers["ones"] = torch.ones(reqs, dtype=torch.int32, device=self.device)
        return self._graph_buffers

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        assert abs(scale - self.scale) < 1e-12, "FlashInfer plans use head_dim**-0.5"
        meta: FlashInferMetadata = batch.attn_metadata
        pool = batch.kv_pool
        # NOTE: [num_slots, Hkv, D] viewed as pages of one token: [num_slots, 1, Hkv, D].
        kv = (pool.k_cache[layer_id].unsqueeze(1), pool.v_cache[layer_id].unsqueeze(1))
        # q is a strided view of the qkv projection. The prefill kernel takes its strides (the
        # whole prompt's q is not copied); the decode wrapper gets a contiguous copy (one row per
        # sequence, cheap). The copy was added while chasing wrong eager beam steps on the H200,
        # which turned out to be the RoPE kernel's slot indexing; decode with a strided q has not
        # been checked on its own since, so the copy stays.
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
