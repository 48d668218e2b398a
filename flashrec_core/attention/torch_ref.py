"""Pure-torch paged attention: runs everywhere, the correctness oracle for the GPU backends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.attention.step import StepInput
    from flashrec_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """Padded gather indices for a step: B sequences, up to Q queries and K keys each."""

    kv_slots: torch.Tensor  # [B, K] pool slots (padding -> slot 0)
    query_index: torch.Tensor  # [B, Q] token index into the step (padding -> 0)
    query_valid: torch.Tensor  # [B, Q] bool
    masks: Mapping[int | None, torch.Tensor]
    """sliding window (None = whole context) -> [B, 1, 1, Q, K] bool: causal, in range and
    inside the window; one mask per distinct window of the model's layers."""


class TorchAttentionBackend:
    """Gathers each sequence's K/V into a padded block and runs masked softmax attention in fp32.

    `layers` holds each layer's `AttentionSpec` (soft-cap and sliding window; the scale comes
    with each call); without it every layer attends over the whole context, uncapped.
    """

    name = "torch"
    supports_graphs = False

    def __init__(
        self, device: torch.device, *, layers: Sequence[AttentionSpec] = (), **_: object
    ) -> None:
        self.device = device
        self.layers = tuple(layers)
        self.windows = sorted({s.sliding_window for s in self.layers} - {None}) or []

    def plan(self, step: StepInput) -> TorchAttentionMetadata:
        qo_indptr, kv_indptr = step.qo_indptr, step.kv_indptr
        kv_indices = step.flat_kv_indices().cpu()
        qo_len = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        kv_len = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        num_seq, max_q, max_k = len(qo_len), max(qo_len), max(kv_len)
        kv_slots = torch.zeros((num_seq, max_k), dtype=torch.int64)
        query_index = torch.zeros((num_seq, max_q), dtype=torch.int64)
        query_valid = torch.zeros((num_seq, max_q), dtype=torch.bool)
        # keys sit at positions 0..kv_len-1 (slots in position order); -1 pads
        query_pos = torch.full((num_seq, max_q), -1, dtype=torch.int64)
        for b in range(num_seq):
            q0, k0 = int(qo_indptr[b]), int(kv_indptr[b])
            kv_slots[b, : kv_len[b]] = kv_indices[k0 : k0 + kv_len[b]]
            query_index[b, : qo_len[b]] = torch.arange(q0, q0 + qo_len[b])
            query_valid[b, : qo_len[b]] = True
            # query i sits at position kv_len - qo_len + i and sees keys up to it
            query_pos[b, : qo_len[b]] = kv_len[b] - qo_len[b] + torch.arange(qo_len[b])
        key_pos = torch.arange(max_k)[None, None, :]
        causal = key_pos <= query_pos[:, :, None]  # [B, Q, K]; padded queries see nothing
        masks = {None: causal}
        for w in self.windows:
            masks[w] = causal & (key_pos > query_pos[:, :, None] - w)
        dev = self.device
        return TorchAttentionMetadata(
            kv_slots.to(dev), query_index.to(dev), query_valid.to(dev),
            {w: m[:, None, None].to(dev) for w, m in masks.items()},
        )  # fmt: skip

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Attends over the pool (the step's `new_kv` were stored there already)."""
        pool = batch.kv_pool
        return self.attend(
            q, pool.k_cache[layer_id], pool.v_cache[layer_id], layer_id, scale, batch.attn_metadata
        )

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer_id: int,
        scale: float, meta: TorchAttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """The plan's attention over any table of keys and values [N, Hkv, D] that its slots
        index: the pool, or `FreshPrefillAttention`'s buffers."""
        spec = self.layers[layer_id] if self.layers else None
        k = keys[meta.kv_slots].float()  # [B, K, Hkv, D]
        v = values[meta.kv_slots].float()
        num_kv = k.shape[2]
        group = q.shape[1] // num_kv
        qp = q[meta.query_index].float()  # [B, Q, Hq, D]
        qp = qp.unflatten(2, (num_kv, group))  # [B, Q, Hkv, G, D]
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qp, k) * scale
        if spec is not None and spec.logit_softcap is not None:
            scores = spec.logit_softcap * torch.tanh(scores / spec.logit_softcap)
        mask = meta.masks[spec.sliding_window if spec is not None else None]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).flatten(2, 3)  # [B, Q, Hq, D]
        return out[meta.query_valid].to(q.dtype)
