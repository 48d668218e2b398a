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
