"""FlashInfer paged attention over the token-slot pool (page size 1), with cascade for beams.

Three wrappers, one plan per step (outside the layers), reused by every layer:

| step                                   | wrapper                                          |
| -------------------------------------- | ------------------------------------------------ |
| prefill (several queries per sequence) | BatchPrefillWithPagedKVCacheWrapper, causal      |
| decode, flat                           | BatchDecodeWithPagedKVCacheWrapper (tensor cores)|
| beam decode with a shared prompt       | MultiLevelCascadeAttentionWrapper, 2 levels      |

Cascade reads each request's prompt KV once for all its beams (level 0), then each beam's own
few decode slots (level 1), and merges the two softmax states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashrec_core.engine.model_runner import StepInput
    from flashrec_core.layers.batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class FlashInferMetadata:
    wrapper: Any
    kind: str  # "prefill" | "decode" | "cascade"


class FlashInferAttentionBackend:
    name = "flashinfer"

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
    ) -> None:
        import flashinfer

        self.device = device
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.cascade = cascade
        self.scale = head_dim**-0.5

        def workspace() -> torch.Tensor:
            return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_tensor_cores=num_q_heads != num_kv_heads
        )
        self.cascade_wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace(), "NHD")

    def _dev(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, torch.int32, non_blocking=True)

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.int32, device=self.device)

    def plan(self, step: StepInput) -> FlashInferMetadata:
        hq, hkv, d = self.shape
        common = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.scale)
        num_seq = step.qo_indptr.numel() - 1
        one_query_each = step.input_ids.numel() == num_seq
        if self.cascade and step.shared_prefix is not None:
            sp = step.shared_prefix
            num_req = sp.prefix_qo_indptr.numel() - 1
            self.cascade_wrapper.plan(
                [self._dev(sp.prefix_qo_indptr), self._dev(step.qo_indptr)],
                [self._dev(sp.prefix_kv_indptr), self._dev(sp.suffix_kv_indptr)],
                [self._dev(sp.prefix_kv_indices), self._dev(sp.suffix_kv_indices)],
                [self._ones(num_req), self._ones(num_seq)],
                hq, hkv, d, 1, causal=False, **common,
            )  # fmt: skip
            return FlashInferMetadata(self.cascade_wrapper, "cascade")
        if one_query_each:
            self.decode.plan(
                self._dev(step.kv_indptr), self._dev(step.flat_kv_indices()), self._ones(num_seq),
                hq, hkv, d, 1, **common,
            )  # fmt: skip
            return FlashInferMetadata(self.decode, "decode")
        self.prefill.plan(
            self._dev(step.qo_indptr), self._dev(step.kv_indptr), self._dev(step.flat_kv_indices()),
            self._ones(num_seq), hq, hkv, d, 1, causal=True, **common,
        )  # fmt: skip
        return FlashInferMetadata(self.prefill, "prefill")

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        assert abs(scale - self.scale) < 1e-12, "FlashInfer plans use head_dim**-0.5"
        meta: FlashInferMetadata = batch.attn_metadata
        pool = batch.kv_pool
        # NOTE: [num_slots, Hkv, D] viewed as pages of one token: [num_slots, 1, Hkv, D].
        kv = (pool.k_cache[layer_id].unsqueeze(1), pool.v_cache[layer_id].unsqueeze(1))
        return meta.wrapper.run(q.contiguous(), kv)
