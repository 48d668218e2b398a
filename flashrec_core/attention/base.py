"""The attention backend protocol: plan once per step outside the layers, run per layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from flashrec_core.engine.model_runner import StepInput
    from flashrec_core.layers.batch import ForwardBatch


class AttentionBackend(Protocol):
    """Paged attention over token slots (page size 1).

    Sequence b's queries are tokens qo_indptr[b]:qo_indptr[b+1] of the step; its keys are the
    slots kv_indices[kv_indptr[b]:kv_indptr[b+1]], in position order, the step's own tokens last
    (their K/V are stored before attention runs). Attention is causal within the sequence.
    """

    name: str

    def plan(self, step: StepInput) -> Any:
        """Build this step's metadata from the step's host index arrays (int64, CPU); a backend
        may use `step.shared_prefix` (cascade) instead of the flat per-row indices."""
        ...

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, D] -> out [T, Hq, D] in q's dtype."""
        ...


def graph_index_buffers(device: torch.device, **lengths: int) -> dict[str, torch.Tensor]:
    """Zeroed int32 index buffers that CUDA-graph-mode plans fill before each replay (their
    addresses are baked into the captured kernels)."""
    return {name: torch.zeros(n, dtype=torch.int32, device=device) for name, n in lengths.items()}
