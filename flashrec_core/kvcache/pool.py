"""Token-granular KV pool (page size 1): one K and one V tensor per layer, BF16 or FP8 e4m3."""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """The KV pool cannot hold what a request needs right now."""


class KVPool:
    """K/V storage indexed by slot: `k_cache[layer]` is [num_slots, num_kv_heads, head_dim].

    Slot 0 is reserved as the padding slot: padded rows of a CUDA-graph batch write there, so they
    can never corrupt a real sequence's K/V. FP8 stores are plain casts (scale 1.0).
    """

    PAD_SLOT = 0

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_kv_heads * head_dim * num_layers * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k_cache) + sum(t.nbytes for t in self.v_cache)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache[layer_id][loc] = k.to(self.dtype)
        self.v_cache[layer_id][loc] = v.to(self.dtype)


class SlotAllocator:
    """Free-list of pool slots (host side: allocation happens between steps, never in a graph)."""

    def __init__(self, num_slots: int) -> None:
        # Slot 0 is the padding slot and is never handed out.
        self._free = torch.arange(num_slots - 1, 0, -1, dtype=torch.int64)
        self._top = num_slots - 1
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise OutOfSlotsError(
                f"KV pool needs {n} free token slots but has {self._top} of {self.num_slots - 1}; "
                "raise --kv-cache-tokens / --mem-fraction or send fewer or shorter requests"
            )
        self._top -= n
        return self._free[self._top : self._top + n].flip(0).clone()

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        assert self._top + n <= self.num_slots - 1, "freeing more slots than were allocated"
        self._free[self._top : self._top + n] = slots.flatten().cpu()
        self._top += n


class RequestTable:
    """Request -> token-slot table: row r holds the pool slots of request r's prompt.

    Beams of a request share these slots by index (no KV copy); their few decode slots live in
    the beam state and are remapped by parent after each step.
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        # int32: slot ids fit, and the table is max_requests x max_context entries.
        self.slots = torch.zeros((max_requests, max_context), dtype=torch.int32, device=device)
        self.lengths = [0] * max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_context = max_context

    def add(self, slots: torch.Tensor) -> int:
        if not self._free_rows:
            raise OutOfSlotsError(f"request table is full ({len(self.lengths)} requests)")
        if slots.numel() > self.max_context:
            raise OutOfSlotsError(
                f"prompt of {slots.numel()} tokens exceeds the context limit {self.max_context}; "
                "raise --max-context (EngineConfig.max_context)"
            )
        row = self._free_rows.pop()
        self.slots[row, : slots.numel()] = slots.to(self.slots.device, non_blocking=True)
        self.lengths[row] = slots.numel()
        return row

    def get(self, row: int) -> torch.Tensor:
        return self.slots[row, : self.lengths[row]].long()

    def remove(self, row: int) -> None:
        if row in self._free_rows:
            raise ValueError(f"request table row {row} is not in use (removed twice?)")
        self.lengths[row] = 0
        self._free_rows.append(row)

    @property
    def num_active(self) -> int:
        return len(self.lengths) - len(self._free_rows)
