"""Pure-torch paged attention: runs everywhere, the correctness oracle for the GPU backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashrec_core.engine.model_runner import StepInput
    from flashrec_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """Padded gather indices for a step: B sequences, up to Q queries and K keys each."""

    kv_slots: torch.Tensor  # [B, K] pool slots (padding -> slot 0)
    query_index: torch.Tensor  # [B, Q] token index into the step (padding -> 0)
    query_valid: torch.Tensor  # [B, Q] bool
    mask: torch.Tensor  # [B, 1, 1, Q, K] bool: causal and in-range


class TorchAttentionBackend:
    """Gathers each sequence's K/V into a padded block and runs masked softmax attention in fp32."""

    name = "torch"

    def __init__(self, device: torch.device, **_: object) -> None:
        self.device = device

    def plan(self, step: StepInput) -> TorchAttentionMetadata:
        qo_indptr, kv_indptr = step.qo_indptr, step.kv_indptr
        kv_indices = step.flat_kv_indices().cpu()
        qo_len = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        kv_len = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        num_seq, max_q, max_k = len(qo_len), max(qo_len), max(kv_len)
        kv_slots = torch.zeros((num_seq, max_k), dtype=torch.int64)
        query_index = torch.zeros((num_seq, max_q), dtype=torch.int64)
        query_valid = torch.zeros((num_seq, max_q), dtype=torch.bool)
        mask = torch.zeros((num_seq, max_q, max_k), dtype=torch.bool)
        key_pos = torch.arange(max_k)
        for b in range(num_seq):
            q0, k0 = int(qo_indptr[b]), int(kv_indptr[b])
            kv_slots[b, : kv_len[b]] = kv_indices[k0 : k0 + kv_len[b]]
            query_index[b, : qo_len[b]] = torch.arange(q0, q0 + qo_len[b])
            query_valid[b, : qo_len[b]] = True
            # query i sits at position kv_len - qo_len + i and sees keys up to it
            last_key = kv_len[b] - qo_len[b] + torch.arange(qo_len[b])
            mask[b, : qo_len[b]] = key_pos[None, :] <= last_key[:, None]
        dev = self.device
        return TorchAttentionMetadata(
            kv_slots.to(dev), query_index.to(dev), query_valid.to(dev), mask[:, None, None].to(dev)
        )

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TorchAttentionMetadata = batch.attn_metadata
        pool = batch.kv_pool
        k = pool.k_cache[layer_id][meta.kv_slots].float()  # [B, K, Hkv, D]
        v = pool.v_cache[layer_id][meta.kv_slots].float()
        num_kv = k.shape[2]
        group = q.shape[1] // num_kv
        qp = q[meta.query_index].float()  # [B, Q, Hq, D]
        qp = qp.unflatten(2, (num_kv, group))  # [B, Q, Hkv, G, D]
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qp, k) * scale
        scores = scores.masked_fill(~meta.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).flatten(2, 3)  # [B, Q, Hq, D]
        return out[meta.query_valid].to(q.dtype)
