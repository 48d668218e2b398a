"""The attention call every model makes: store K/V (unless a fused kernel did) and attend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.layers.batch import ForwardBatch


def split_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-copy per-head views [T, H, D] of a fused qkv output [T, (Hq + 2 Hkv) * D]."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.unflatten(-1, (num_q_heads, head_dim)),
        k.unflatten(-1, (num_kv_heads, head_dim)),
        v.unflatten(-1, (num_kv_heads, head_dim)),
    )


class Attention(nn.Module):
    """Scaled dot-product attention over the paged KV pool through the batch's backend.

    `spec` is the layer's `AttentionSpec` (contract v2: scale, soft-cap, sliding window), or a
    bare scale (v1). The backend was planned for `ModelConfig.attention_spec(layer_id)`; the
    conformance suite checks that the two agree.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        spec: AttentionSpec | float,
    ) -> None:
        super().__init__()
        assert num_q_heads % num_kv_heads == 0, "GQA needs q heads to be a multiple of kv heads"
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.spec = spec if isinstance(spec, AttentionSpec) else AttentionSpec(scale=float(spec))
        self.scale = self.spec.scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        skip_store: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. skip_store: K/V already in the pool."""
        if not skip_store:
            batch.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        out = batch.attn_backend.forward(q, layer_id, self.scale, batch, new_kv=(k, v))
        return out.reshape(q.shape[0], self.num_q_heads * self.head_dim)
