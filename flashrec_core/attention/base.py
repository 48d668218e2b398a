"""The attention backend protocol: plan once per step outside the layers, run per layer.

Layers that attend alike (same `AttentionSpec`: scale, soft-cap, sliding window) share one plan
per step; `LayerGroups` says which layers those are. `window_shared_prefix` turns a beam step's
prompt level into what a windowed layer sees, for the cascade and Triton beam paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flashrec_core.attention.step import SharedPrefix
from flashrec_core.spec import AttentionSpec

if TYPE_CHECKING:
    from flashrec_core.attention.step import StepInput
    from flashrec_core.layers.batch import ForwardBatch


class AttentionBackend(Protocol):
    """Paged attention over token slots (page size 1).

    Sequence b's queries are tokens qo_indptr[b]:qo_indptr[b+1] of the step; its keys are the
    slots kv_indices[kv_indptr[b]:kv_indptr[b+1]], in position order, the step's own tokens last
    (their K/V are stored before attention runs). Attention is causal within the sequence, and
    each layer honours its `AttentionSpec` (soft-cap, sliding window) given at construction.
    """

    name: str
    supports_graphs: bool
    """Whether `graph_attention` and `plan(step, graph=...)` work (beam steps in CUDA graphs)."""

    def plan(self, step: StepInput, graph: Any = None) -> Any:
        """Build this step's metadata from the step's host index arrays (int64, CPU); a backend
        may use `step.shared_prefix` (cascade) instead of the flat per-row indices. With `graph`
        (from `graph_attention`), fill that shape's fixed buffers for a replay instead."""
        ...

    def graph_attention(self, num_requests: int, num_rows: int) -> Any:
        """Fixed-address state for one captured beam-step shape (supports_graphs only). The
        Triton beam kernel's wrapper also takes `suffix_width`: a shape whose rows carry up to
        that many own slots, fewer padded (merged steps of waves at several levels)."""
        ...

    # Optional: backends with `supports_prefill_graphs = True` also implement
    # `prefill_graph_attention(num_sequences, max_tokens)`, the fixed-address state of a captured
    # prefill of that many sequences, planned through `plan(step, graph=...)`.

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, Hq, D] -> out [T, Hq, D] in q's dtype. `new_kv`: the step's own keys and
        values [T, Hkv, D] as the layer computed them (rotated, in the model's dtype, stored in
        the pool already); a backend that attends over them rather than reading them back from
        the pool takes them (`FreshPrefillAttention`), the others ignore them."""
        ...


class BackendWrapper:
    """A backend that runs some steps itself and leaves the rest to `inner` (the Triton beam
    and prefill wrappers, fresh prefills): a step whose plan is not of `plan_type` goes to
    `inner`, as do beam-step graphs unless a wrapper owns them. Subclasses set `inner` and
    `plan_type` and implement `attend`."""

    inner: AttentionBackend
    plan_type: type

    def graph_attention(self, num_requests: int, num_rows: int, **shape: Any) -> Any:
        """Beam-step graphs belong to the wrapped backend (`shape`: its further arguments,
        such as the Triton beam kernel's `suffix_width`)."""
        return self.inner.graph_attention(num_requests, num_rows, **shape)

    def forward(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        plan = batch.attn_metadata
        if not isinstance(plan, self.plan_type):
            return self.inner.forward(q, layer_id, scale, batch, new_kv)
        return self.attend(q, layer_id, scale, batch, plan, new_kv)

    def attend(
        self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch, plan: Any,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        """This wrapper's own steps (`plan` is of `plan_type`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class LayerGroups:
    """The distinct attention specs of a model and the group index of each layer."""

    specs: tuple[AttentionSpec, ...]
    of_layer: tuple[int, ...]

    @classmethod
    def create(cls, layers: Sequence[AttentionSpec], default_scale: float) -> LayerGroups:
        """One group per distinct spec; no layers given (v1 callers): one default group."""
        if not layers:
            return cls((AttentionSpec(scale=default_scale),), ())
        specs = tuple(dict.fromkeys(layers))
        return cls(specs, tuple(specs.index(s) for s in layers))

    def group(self, layer_id: int) -> int:
        return self.of_layer[layer_id] if self.of_layer else 0

    def spec(self, layer_id: int) -> AttentionSpec:
        return self.specs[self.group(layer_id)]


def window_shared_prefix(sp: SharedPrefix, window: int | None) -> SharedPrefix:
    """The prompt level of a beam step as a layer with sliding window W sees it.

    Every row of request b sits at position L_b + S_b - 1 (L_b prompt slots, S_b own slots, the
    same S_b for every row of the request; a merged step's requests may differ), so it sees
    prompt positions L_b + S_b - W .. L_b - 1 and all its own slots: one truncation per
    request, shared by its rows. Host-side index math; the indices are gathered on their own
    device.
    """
    if window is None:
        return sp
    own = request_own_slots(sp)
    if own.numel() and int(own.max()) >= window:
        raise ValueError(
            f"sliding window {window} <= {int(own.max())} own slots of a beam row: the window "
            "must be longer than the SID depth"
        )
    ptr = sp.prefix_kv_indptr.to(torch.int64).cpu()
    lengths = ptr[1:] - ptr[:-1]
    start = (lengths + own - window).clamp(min=0)
    if not bool(start.any()):
        return sp
    keep = lengths - start
    new_ptr = torch.zeros_like(ptr)
    new_ptr[1:] = keep.cumsum(0)
    offset = torch.arange(int(new_ptr[-1])) - torch.repeat_interleave(new_ptr[:-1], keep)
    gather = torch.repeat_interleave(ptr[:-1] + start, keep) + offset
    indices = sp.prefix_kv_indices[gather.to(sp.prefix_kv_indices.device)]
    return SharedPrefix(
        sp.prefix_qo_indptr, new_ptr.to(sp.prefix_kv_indptr.dtype), indices,
        sp.suffix_kv_indptr, sp.suffix_kv_indices,
    )  # fmt: skip


def request_own_slots(sp: SharedPrefix) -> torch.Tensor:
    """Own slots per request (host int64 [B]): those of its first row (all its rows have as
    many); 1 for a request without rows."""
    rows = sp.prefix_qo_indptr.to(torch.int64).cpu()
    per_row = sp.suffix_kv_indptr.to(torch.int64).cpu()
    per_row = per_row[1:] - per_row[:-1]
    first = rows[:-1].clamp(max=max(per_row.numel() - 1, 0))
    has_rows = rows[1:] > rows[:-1]
    own = per_row[first] if per_row.numel() else torch.ones_like(first)
    return torch.where(has_rows, own, torch.ones_like(own))


def graph_index_buffers(
    device: torch.device, dtype: torch.dtype = torch.int32, **lengths: int
) -> dict[str, torch.Tensor]:
    """Zeroed index buffers that CUDA-graph-mode plans fill before each replay (their
    addresses are baked into the captured kernels)."""
    return {name: torch.zeros(n, dtype=dtype, device=device) for name, n in lengths.items()}


def check_prefill_graph_room(
    max_graph: tuple[int, int], sequences: int, tokens: int, owner: str
) -> None:
    """A prefill graph of `sequences` x `tokens` must fit the buffers `owner` allocated once
    for the largest graph, `max_graph` (tokens, sequences)."""
    most_tokens, most_sequences = max_graph
    if tokens > most_tokens or sequences > most_sequences:
        raise ValueError(
            f"a prefill graph of {sequences} sequences x {tokens} tokens exceeds the {owner} "
            f"buffers ({most_sequences} x {most_tokens})"
        )
