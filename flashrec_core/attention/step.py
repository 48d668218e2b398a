"""The step types shared by the attention backends and the engine: what one forward step reads.

They live below both (the engine builds them in `prepare_*`, the backends plan from them), so
`attention/` never imports `engine/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """Two-level view of a beam decode step, for cascade attention.

    Level 0: rows of request b (prefix_qo_indptr[b]:prefix_qo_indptr[b+1]) share the prompt
    slots prefix_kv_indices[prefix_kv_indptr[b]:prefix_kv_indptr[b+1]]. Level 1: row r's own
    slots suffix_kv_indices[suffix_kv_indptr[r]:suffix_kv_indptr[r+1]] (ancestors + its own).
    """

    prefix_qo_indptr: torch.Tensor
    prefix_kv_indptr: torch.Tensor
    prefix_kv_indices: torch.Tensor
    suffix_kv_indptr: torch.Tensor
    suffix_kv_indices: torch.Tensor


def flatten_shared_prefix(sp: SharedPrefix) -> torch.Tensor:
    """Flat per-row slot lists (row r: its request's prefix slots, then its suffix slots),
    concatenated, on the device of the suffix indices. Vectorized: no host loop over rows."""
    device = sp.suffix_kv_indices.device
    rows_per_req = sp.prefix_qo_indptr[1:] - sp.prefix_qo_indptr[:-1]
    req = torch.repeat_interleave(torch.arange(rows_per_req.numel()), rows_per_req)
    req = req.to(device, non_blocking=True)
    prefix_ptr = sp.prefix_kv_indptr.to(device, non_blocking=True)
    suffix_ptr = sp.suffix_kv_indptr.to(device, non_blocking=True)
    prefix_len = (prefix_ptr[1:] - prefix_ptr[:-1])[req]
    kv_len = prefix_len + (suffix_ptr[1:] - suffix_ptr[:-1])
    rows = torch.repeat_interleave(torch.arange(req.numel(), device=device), kv_len)
    starts = torch.cumsum(kv_len, 0) - kv_len
    pos = torch.arange(rows.numel(), device=device) - starts[rows]  # position within the row
    in_prefix = pos < prefix_len[rows]
    prefix = sp.prefix_kv_indices.to(device, non_blocking=True)
    from_prefix = prefix[(prefix_ptr[req][rows] + pos).clamp(max=max(prefix.numel() - 1, 0))]
    from_suffix = sp.suffix_kv_indices[
        (suffix_ptr[rows] + pos - prefix_len[rows]).clamp(
            min=0, max=sp.suffix_kv_indices.numel() - 1
        )
    ]
    return torch.where(in_prefix, from_prefix, from_suffix)


def dense_suffix(sp: SharedPrefix, width: int | None = None) -> torch.Tensor:
    """Each row's own slots as a [R, width] tensor on the suffix indices' device (None: the
    widest row's count), rows with fewer padded with -1 (no slot: the beam kernel skips it).
    The lengths are read from the host indptr, so no device sync; uniform rows are a view."""
    ptr = sp.suffix_kv_indptr.to(torch.int64)
    lens = ptr[1:] - ptr[:-1]
    flat = sp.suffix_kv_indices
    widest = int(lens.max()) if lens.numel() else 1
    width = widest if width is None else width
    if widest > width:
        raise ValueError(f"a row has {widest} own slots, more than the width {width}")
    if lens.numel() == 0 or bool((lens == width).all()):
        return flat.view(lens.numel(), width)
    col = torch.arange(width)
    used = col < lens[:, None]  # host [R, width]
    take = torch.where(used, ptr[:-1, None] + col, 0).to(flat.device, non_blocking=True)
    return torch.where(used.to(flat.device, non_blocking=True), flat[take], -1)


@dataclass(frozen=True)
class StepInput:
    """Host-side description of one forward step over several sequences (built in prepare_*).

    Sequence b contributes tokens input_ids[qo_indptr[b]:qo_indptr[b+1]] and attends to the slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (its own new slots last).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor | None  # [sum kv]; None when only shared_prefix is given
    shared_prefix: SharedPrefix | None = None

    def is_prompt_prefill(self) -> bool:
        """Several queries per sequence and no beam-step prefix: a prompt (or a chunk of one)."""
        return self.shared_prefix is None and self.input_ids.numel() > self.qo_indptr.numel() - 1

    def flat_kv_indices(self) -> torch.Tensor:
        """Per-row slot lists, derived from the two-level view when only that was built."""
        if self.kv_indices is not None:
            return self.kv_indices
        assert self.shared_prefix is not None, "a step has flat indices or a shared prefix"
        return flatten_shared_prefix(self.shared_prefix)
