"""Runs one wave of requests through prefill and `depth` beam-search steps.

KV layout of a wave: each request's prompt occupies its own slots (a row of the request table);
beams share them by index. Every beam row r owns one decode slot per step, `decode_slots[r, s]`;
after each selection the history of slots is gathered by parent, so a beam's KV is
prompt slots + the slots its ancestors wrote (no KV is ever copied). All slots are freed when
the wave ends, whatever happens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from flashrec_core.config import triton_usable
from flashrec_core.engine.cuda_graph import DecodeGraphs
from flashrec_core.engine.model_runner import ModelRunner, SharedPrefix, StepInput, prepare_prefill
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.kvcache import KVPool
from flashrec_core.kvcache.radix import RadixNode
from flashrec_core.search.beam import (
    NEG_INF,
    BeamLayout,
    Selection,
    expand_beams,
    gumbel_noise,
)
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.sid_layout import SidLayout
from flashrec_core.search.trie import Trie


@dataclass(frozen=True)
class WaveOutput:
    """Final beams of every request, rows laid out as in `layout` (best first per request)."""

    layout: BeamLayout
    codes: torch.Tensor  # [R, depth]
    scores: torch.Tensor  # [R] cumulative log-probs, -inf for dead beams
    nodes: torch.Tensor  # [R] catalog rows (meaningless without a catalog)


class BeamWave:
    """Beam search over a batch of requests sharing one forward per step."""

    def __init__(
        self, runner: ModelRunner, head: RestrictedLMHead, trie: Trie, layout: SidLayout
    ) -> None:
        self.runner = runner
        self.head = head
        self.trie = trie
        self.sid = layout
        ecfg = runner.loaded.engine_config
        self.trie_kernel = (
            runner.device.type == "cuda" and ecfg.enable_fused_trie_topk and triton_usable(ecfg)[0]
        )
        """Selection through the fused trie-mask + top-k Triton kernel (else its torch reference)."""
        self.graphs = DecodeGraphs.create(runner, self._graph_step)
        """Whole-step CUDA graphs of the decode steps; None when steps always run eagerly."""
        self.eager_padding: Callable[[list[int]], int] | None = None
        """Without graphs: pad each wave to this many requests anyway (tests of the padding)."""
        self.timeline: list[tuple[str, torch.cuda.Event]] | None = None
        """When a list (benchmarks on CUDA), CUDA events are recorded at each stage boundary."""

    def _mark(self, name: str) -> None:
        if self.timeline is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.timeline.append((name, event))

    def run(self, requests: list[GenerationRequest]) -> WaveOutput:
        runner, device = self.runner, self.runner.device
        allocator, table, cache = runner.allocator, runner.request_table, runner.prefix_cache
        prompt_slots: list[torch.Tensor] = []
        cached_lens: list[int] = []
        locked: list[RadixNode] = []
        table_rows: list[int] = []
        decode_slots = None
        done = False
        try:
            for req in requests:
                cached = torch.empty(0, dtype=torch.int64)
                if cache is not None:  # at least the last prompt token is computed
                    cached, node = cache.match(req.prompt_ids, len(req.prompt_ids) - 1)
                    cache.lock(node)
                    locked.append(node)
                new = self._alloc(len(req.prompt_ids) - cached.numel())
                prompt_slots.append(torch.cat([cached, new]))
                cached_lens.append(cached.numel())
                table_rows.append(table.add(prompt_slots[-1]))
            num_rows = sum(r.n for r in requests)
            steps = self.trie.depth - 1
            decode_slots = self._alloc(num_rows * steps).view(num_rows, steps)
            out = self._search(requests, table_rows, cached_lens, decode_slots.to(device))
            done = True
            return out
        finally:
            self._release(requests, prompt_slots, cached_lens, locked, table_rows, done)
            if decode_slots is not None:
                allocator.free(decode_slots)

    def _alloc(self, n: int) -> torch.Tensor:
        """Slots from the pool, evicting unused cached prefixes when it runs short."""
        allocator, cache = self.runner.allocator, self.runner.prefix_cache
        if cache is not None and allocator.num_free < n:
            cache.evict(n - allocator.num_free)
        return allocator.alloc(n)

    def _release(
        self,
        requests: list[GenerationRequest],
        prompt_slots: list[torch.Tensor],
        cached_lens: list[int],
        locked: list[RadixNode],
        table_rows: list[int],
        done: bool,
    ) -> None:
        """Prompt slots go to the prefix cache after a successful wave; otherwise (or without a
        cache) the newly computed ones are freed. Cached prefixes are unlocked either way."""
        cache = self.runner.prefix_cache
        for req, slots, cached in zip(requests, prompt_slots, cached_lens):
            if cache is not None and done:
                cache.insert(req.prompt_ids, slots)
            else:
                self.runner.allocator.free(slots[cached:])
        for node in locked:
            assert cache is not None, "only a cache locks nodes"
            cache.unlock(node)
        for row in table_rows:
            self.runner.request_table.remove(row)

    def _search(
        self,
        requests: list[GenerationRequest],
        table_rows: list[int],
        cached_lens: list[int],
        decode_slots: torch.Tensor,
    ) -> WaveOutput:
        device = self.runner.device
        prompts = [list(r.prompt_ids) for r in requests]
        noise = _NoiseSource(requests, device)
        widths = [r.n for r in requests]
        graphs = self.graphs
        padded = graphs.padded_requests(widths, noise.sampling) if graphs is not None else None
        if graphs is None and self.eager_padding is not None:
            padded = self.eager_padding(widths)
        num_pad = (padded - len(requests)) if padded is not None else 0
        first = BeamLayout.create([1] * len(requests), device)
        real = BeamLayout.create(widths, device)
        beams = BeamLayout.create(widths + [widths[0]] * num_pad, device) if num_pad else real
        slots = [self.runner.request_table.get(row) for row in table_rows]
        self._mark("start")
        step = prepare_prefill(prompts, [s.cpu() for s in slots], cached_lens)
        hidden = self.runner.forward(step)[(step.qo_indptr[1:] - 1).to(device)]
        sel = self._select(hidden, 0, torch.zeros(len(requests), device=device),
                           torch.zeros(len(requests), dtype=torch.int64, device=device),
                           first, real, noise)  # fmt: skip
        self._mark("prefill")
        # Pad requests (graph shapes): one pad slot of prompt each, dead beams, pad decode slots.
        sel = _pad_rows(sel, beams.num_rows)
        pad_slots = torch.full((num_pad,), KVPool.PAD_SLOT, dtype=torch.int64, device=device)
        decode_slots = _pad_rows_of(decode_slots, beams.num_rows, KVPool.PAD_SLOT)
        codes, history = sel.code[:, None], decode_slots[:, :0]
        prompt_lens = torch.tensor([len(p) for p in prompts] + [1] * num_pad)
        all_prompts = torch.cat(slots + [pad_slots])  # on the device, once per wave
        row_request = beams.row_request.cpu()
        row_prompt_len = prompt_lens.to(device)[beams.row_request]
        if graphs is not None and padded is None:
            graphs.count_eager(self.trie.depth - 1)
        for level in range(1, self.trie.depth):
            own = decode_slots[:, level - 1]
            step = prepare_beam_decode(
                tokens=self.sid.level_starts[level - 1] + codes[:, -1],
                positions=row_prompt_len + level - 1, prompts=all_prompts,
                prompt_lens=prompt_lens, row_request=row_request, history=history, own=own,
            )  # fmt: skip
            if graphs is not None and padded is not None:
                sel = graphs.run(level, step, sel.score, sel.node, beams)
            else:
                hidden = self.runner.forward(step)
                sel = self._select(hidden, level, sel.score, sel.node, beams, beams, noise)
            history = torch.cat([history, own[:, None]], dim=1)[sel.parent]
            codes = torch.cat([codes[sel.parent], sel.code[:, None]], dim=1)
            self._mark(f"decode{level}")
        rows = real.num_rows
        return WaveOutput(real, codes[:rows], sel.score[:rows], sel.node[:rows])

    def _select(
        self,
        hidden: torch.Tensor,
        level: int,
        parent_score: torch.Tensor,
        nodes: torch.Tensor,
        parents: BeamLayout,
        out: BeamLayout,
        noise: _NoiseSource,
    ) -> Selection:
        log_probs = self.head.log_probs(hidden, level)
        return expand_beams(
            self.trie, level, nodes, parent_score.float(), log_probs, parents, out,
            noise.draw(parents, self.trie.max_children(level)), use_kernel=self.trie_kernel,
        )  # fmt: skip

    def _graph_step(
        self,
        level: int,
        hidden: torch.Tensor,
        parent_score: torch.Tensor,
        nodes: torch.Tensor,
        layout: BeamLayout,
    ) -> Selection:
        """The captured part of a beam step after the forward: greedy selection, no noise."""
        return self._select(hidden, level, parent_score, nodes, layout, layout, _GREEDY)


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


class _NoiseSource:
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


_GREEDY = _NoiseSource([], torch.device("cpu"))


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


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths, 0)
    return out
