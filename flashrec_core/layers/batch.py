"""The one input of a model forward: tokens, positions, KV slots and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashrec_core.attention import AttentionBackend
    from flashrec_core.kvcache import KVPool


@dataclass
class ForwardBatch:
    """Flattened tokens of every sequence in a step ([T] each), explicit, never global.

    `out_cache_loc[i]` is the pool slot where token i's K/V go. `attn_metadata` is whatever the
    backend's `plan` built for this step (index buffers); layers never look inside it.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    kv_pool: KVPool
    attn_backend: AttentionBackend
    attn_metadata: Any

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def claim_kv_mirror(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a fused K/V store should also copy this layer's new K/V: (k_out, v_out, rows),
        token i to row rows[i], or None. A backend that attends over its own copy of the new
        K/V (`FreshPrefillAttention.claim_kv_mirror`) hands out its buffers and then leaves the
        copy to the caller, which must write it before attention runs."""
        claim = getattr(self.attn_backend, "claim_kv_mirror", None)
        return None if claim is None else claim(self, layer_id)
