"""Inputs of one beam step, built on the host side of the wave: the two-level KV view of a
decode step, the pad requests a CUDA-graph shape adds, and the per-request sampling noise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from flashrec_core.engine.model_runner import SharedPrefix, StepInput
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.kvcache import KVPool
from flashrec_core.search.beam import NEG_INF, BeamLayout, Selection, gumbel_noise


@dataclass(frozen=True)
class Padding:
    """Pad requests appended to a wave for a graph shape: dead beams (score -inf) that read and
    write only the pad slot, one pad slot of prompt each."""

    rows: int
    num_pad: int

    def selection(self, sel: Selection) -> Selection:
        return _pad_rows(sel, self.rows)

    def slots(self, x: torch.Tensor, value: int = KVPool.PAD_SLOT) -> torch.Tensor:
        return _pad_rows_of(x, self.rows, value)

    def prompts(self, prompts: torch.Tensor) -> torch.Tensor:
        if self.num_pad == 0:
            return prompts
        return torch.cat([prompts, prompts.new_full((self.num_pad,), KVPool.PAD_SLOT)])


@dataclass(frozen=True)
class StepShape:
    """What every beam step of a wave at one padded size shares: built once per wave (and
    after a `drop`), not per step, so a step makes no host copy of device data."""

    beams: BeamLayout  # the rows, pad requests included
    pad: Padding
    row_request: torch.Tensor  # host [R]: request of each row
    prompt_lens: torch.Tensor  # host [B + pads]
    row_prompt_len: torch.Tensor  # device [R]
    prompts: torch.Tensor  # device: every request's prompt slots, then one pad slot per pad

    @classmethod
    def create(
        cls, widths: list[int], prompt_lens: list[int], prompts: torch.Tensor, num_pad: int,
        device: torch.device,
    ) -> StepShape:  # fmt: skip
        all_widths = widths + [widths[0]] * num_pad
        beams = BeamLayout.create(all_widths, device)
        lens = torch.tensor(prompt_lens + [1] * num_pad)
        row_request = torch.repeat_interleave(
            torch.arange(len(all_widths)), torch.tensor(all_widths)
        )
        pad = Padding(beams.num_rows, num_pad)
        row_prompt_len = lens.to(device, non_blocking=True)[beams.row_request]
        return cls(beams, pad, row_request, lens, row_prompt_len, pad.prompts(prompts))


def _pad_rows(sel: Selection, rows: int) -> Selection:
    """Selection extended to `rows` with dead pad beams (score -inf, node 0, code 0)."""
    extra = rows - sel.score.shape[0]
    if extra == 0:
        return sel
    pad = partial(torch.zeros, extra, dtype=torch.int64, device=sel.score.device)
    dead = torch.full((extra,), NEG_INF, dtype=sel.score.dtype, device=sel.score.device)
    return Selection(
        torch.cat([sel.parent, pad()]),
        torch.cat([sel.code, pad()]),
        torch.cat([sel.node, pad()]),
        torch.cat([sel.score, dead]),
    )


def _pad_rows_of(x: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])


class NoiseSource:
    """Per-request seeded generators for temperature > 0; None when every request is greedy."""

    def __init__(self, requests: list[GenerationRequest], device: torch.device) -> None:
        self.temperatures = [r.temperature for r in requests]
        self.device = device
        self.generators = [
            torch.Generator().manual_seed(r.seed if r.seed is not None else _fresh_seed())
            if r.temperature > 0
            else None
            for r in requests
        ]

    @property
    def sampling(self) -> bool:
        return any(t > 0 for t in self.temperatures)

    def draw(self, parents: BeamLayout, width: int) -> torch.Tensor | None:
        if not self.sampling:
            return None
        rows = parents.widths.tolist()
        return gumbel_noise(rows, width, self.generators, self.temperatures, self.device)


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def prepare_beam_decode(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    prompts: torch.Tensor,
    prompt_lens: torch.Tensor,
    row_request: torch.Tensor,
    history: torch.Tensor,
    own: torch.Tensor,
) -> StepInput:
    """A decode step: one token per beam row, attending to its request's prompt slots, the
    slots its ancestors wrote (`history` [R, s]) and its own new slot (`own` [R]).

    `prompts` holds every request's prompt slots back to back (`prompt_lens` each, host);
    `row_request` (host) maps rows to requests. Only the two-level view is built; its per-step
    part (`own`, `history`) stays on the device, so the step needs no host sync. Backends that
    want flat per-row indices derive them with `flatten_shared_prefix`.
    """
    num_rows = row_request.numel()
    suffix = torch.cat([history, own[:, None]], dim=1)  # [R, s + 1]
    shared = SharedPrefix(
        prefix_qo_indptr=_indptr(torch.bincount(row_request, minlength=prompt_lens.numel())),
        prefix_kv_indptr=_indptr(prompt_lens),
        prefix_kv_indices=prompts,
        suffix_kv_indptr=_indptr(torch.full((num_rows,), suffix.shape[1])),
        suffix_kv_indices=suffix.flatten(),
    )
    return StepInput(
        input_ids=tokens,
        positions=positions,
        out_cache_loc=own,
        qo_indptr=torch.arange(num_rows + 1, dtype=torch.int64),
        kv_indptr=_indptr(prompt_lens[row_request] + suffix.shape[1]),
        kv_indices=None,
        shared_prefix=shared,
    )


def concat_beam_steps(steps: Sequence[StepInput]) -> StepInput:
    """One beam step over the rows of several: each part's rows, requests, prompt slots and own
    slots after the previous part's. The parts may be waves at different levels (a row's own
    slots are its level's count, so the merged suffix is ragged: `dense_suffix`); one forward
    then reads the weights once for all of them."""
    if len(steps) == 1:
        return steps[0]
    shared = [s.shared_prefix for s in steps]
    assert all(sp is not None for sp in shared), "beam steps carry their two-level view"
    rows = sum(s.input_ids.numel() for s in steps)
    return StepInput(
        input_ids=torch.cat([s.input_ids for s in steps]),
        positions=torch.cat([s.positions for s in steps]),
        out_cache_loc=torch.cat([s.out_cache_loc for s in steps]),
        qo_indptr=torch.arange(rows + 1, dtype=torch.int64),
        kv_indptr=_chain([s.kv_indptr for s in steps]),
        kv_indices=None,
        shared_prefix=SharedPrefix(
            prefix_qo_indptr=_chain([sp.prefix_qo_indptr for sp in shared]),
            prefix_kv_indptr=_chain([sp.prefix_kv_indptr for sp in shared]),
            prefix_kv_indices=torch.cat([sp.prefix_kv_indices for sp in shared]),
            suffix_kv_indptr=_chain([sp.suffix_kv_indptr for sp in shared]),
            suffix_kv_indices=torch.cat([sp.suffix_kv_indices for sp in shared]),
        ),
    )


def pad_requests_step(num_pad: int, width: int, device: torch.device) -> StepInput:
    """A beam step of `num_pad` pad requests of `width` rows: token 0 at position 0, one pad
    slot of prompt each, every row reading and writing only the pad slot (`KVPool.PAD_SLOT`).
    Appended to a merged step to reach a graph shape, or alone to capture one."""
    rows = num_pad * width
    pad = KVPool.PAD_SLOT
    return prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64, device=device),
        positions=torch.zeros(rows, dtype=torch.int64, device=device),
        prompts=torch.full((num_pad,), pad, dtype=torch.int64, device=device),
        prompt_lens=torch.ones(num_pad, dtype=torch.int64),
        row_request=torch.arange(num_pad).repeat_interleave(width),
        history=torch.empty(rows, 0, dtype=torch.int64, device=device),
        own=torch.full((rows,), pad, dtype=torch.int64, device=device),
    )  # fmt: skip


def _chain(indptrs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Host indptrs of consecutive parts as one: each part's offsets after the last's end."""
    out, end = [indptrs[0]], int(indptrs[0][-1])
    for ptr in indptrs[1:]:
        out.append(ptr[1:] + end)
        end += int(ptr[-1])
    return torch.cat(out)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths, 0)
    return out
