"""Runs one wave of requests through prefill and `depth` beam-search steps.

KV layout of a wave: each request's prompt occupies its own slots (a row of the request table);
beams share them by index. Every beam row r owns one decode slot per step, `decode_slots[r, s]`;
after each selection the history of slots is gathered by parent, so a beam's KV is
prompt slots + the slots its ancestors wrote (no KV is ever copied). All slots are freed when
the wave ends, whatever happens.
"""

from __future__ import annotations

import gc
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from flashrec_core.config import triton_usable
from flashrec_core.engine.beam_inputs import (
    NoiseSource,
    StepShape,
    concat_beam_steps,
    prepare_beam_decode,
)
from flashrec_core.engine.catalogs import CatalogVersion
from flashrec_core.engine.cuda_graph import (
    MAX_MIXED_STEP_SHAPES,
    DecodeGraphs,
    GraphVariant,
    MergedPart,
    merged_rows,
    merged_shapes,
)
from flashrec_core.engine.model_runner import ModelRunner, StepInput, prepare_prefill
from flashrec_core.engine.prefill_graph import PrefillGraphs, prefill_chunk_tokens
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.engine.scheduler import Piece, prefill_chunks
from flashrec_core.kvcache.radix import RadixNode
from flashrec_core.search.beam import (
    BeamLayout,
    Selection,
)
from flashrec_core.search.filters import CatalogIndex, FilterMasks
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.selector import BeamSelector
from flashrec_core.search.sid_layout import SidLayout
from flashrec_core.search.trie import Trie


@dataclass(frozen=True)
class WaveOutput:
    """Final beams of every request, rows laid out as in `layout` (in selection order)."""

    layout: BeamLayout
    codes: torch.Tensor  # [R, depth]
    scores: torch.Tensor  # [R] cumulative log-probs, -inf for dead beams
    nodes: torch.Tensor  # [R] catalog rows (meaningless without a catalog)
    path_scores: torch.Tensor  # [R, depth] cumulative log-prob after each level


@dataclass
class WaveState:
    """One wave in flight: its requests' KV resources and their beams after `level` steps.

    Rows are the beams of the wave's requests back to back (`layout`). Resources: request-table
    rows, prompt slots (`cached_lens[i]` of them borrowed from the prefix cache, locked through
    `locked[i]`), and `decode_slots[r, s]`, the slot row r writes at beam step s + 1.
    """

    requests: list[GenerationRequest]
    table_rows: list[int]
    prompt_slots: list[torch.Tensor]  # host, per request
    cached_lens: list[int]
    locked: list[RadixNode | None]
    decode_slots: torch.Tensor  # host [R, depth - 1]
    level: int = 0  # beam levels selected so far
    layout: BeamLayout | None = None
    sel: Selection | None = None
    codes: torch.Tensor | None = None  # [R, level] on the device
    path_scores: torch.Tensor | None = None  # [R, level] cumulative log-prob after each level
    history: torch.Tensor | None = None  # [R, level - 1] decode slots of each beam's ancestors
    prompts: torch.Tensor | None = None  # every request's prompt slots back to back (device)
    device_slots: torch.Tensor | None = None  # decode_slots on the device
    noise: NoiseSource | None = None
    masks: FilterMasks | None = None  # per-request item filters, when any request has one
    trie: Trie | None = None  # the trie of the wave's catalog version
    index: CatalogIndex | None = None  # and its filter index
    variant: GraphVariant | None = None  # the graphs of that version (None: the default trie)
    version: CatalogVersion | None = None
    shapes: dict[int, StepShape] = field(default_factory=dict)  # per pad count, see StepShape
    prefill: PrefillProgress | None = None  # the prefill's forwards still to run (begin)


@dataclass(frozen=True)
class _StepParts:
    """One wave's part of a beam step: its inputs, and what updating the wave after the
    selection reads."""

    step: StepInput
    beams: BeamLayout  # the rows selection covers, pad requests included
    sel: Selection  # the parents: last step's selection, padded
    own: torch.Tensor  # [rows] the slot each row writes now
    history: torch.Tensor  # [rows, level - 1] its ancestors' slots
    padded: int | None  # request count of the graph shape it replays, or None: eager


@dataclass
class PrefillProgress:
    """A wave's prefill between `prefill_some` calls: the forwards still to run (prompt pieces,
    engine/scheduler.py `prefill_chunks`) and the hidden states of the last token of each prompt
    finished so far, in request order (on the device)."""

    prompts: list[list[int]]
    lengths: list[int]
    chunks: deque[list[Piece]]
    parts: list[torch.Tensor] = field(default_factory=list)


class BeamWave:
    """Beam search over a batch of requests sharing one forward per step.

    `begin` allocates a wave's KV and runs its prefill and first selection, `advance` runs one
    beam step, `drop` takes requests out between steps (cancelled, timed out), `finish` returns
    the beams and hands the KV back. `run` does all of it for one wave (bench, tests).
    """

    def __init__(
        self,
        runner: ModelRunner,
        head: RestrictedLMHead,
        trie: Trie,
        layout: SidLayout,
        catalog_index: CatalogIndex | None = None,
    ) -> None:
        self.runner = runner
        self.head = head
        self.trie = trie
        self.sid = layout
        self.catalog_index = catalog_index
        """Item -> SID rows and trie ancestors, for per-request filters (None: no catalog)."""
        ecfg = runner.loaded.engine_config
        trie_kernel = (
            runner.device.type == "cuda" and ecfg.enable_fused_trie_topk and triton_usable(ecfg)[0]
        )
        self.selector = BeamSelector(head, trie_kernel)
        self.graphs = DecodeGraphs.create(runner, self.selector, trie)
        """Whole-step CUDA graphs of the decode steps; None when steps always run eagerly."""
        self.prefill_graphs = PrefillGraphs.create(runner)
        """CUDA graphs of small prefills' forwards; None when prefills always run eagerly."""
        self.prefill_chunk_tokens = prefill_chunk_tokens(ecfg, self.prefill_graphs)
        """A prefill's most new tokens per forward (0: one forward per wave)."""
        merged_graphs = self.graphs is not None and runner.beam_attention == "triton"
        self.merge_steps = (
            merged_graphs
            if ecfg.merge_beam_steps is None
            else ecfg.merge_beam_steps and (self.graphs is None or merged_graphs)
        )
        """Waves in flight share one forward per beam step (`step_groups`). With CUDA graphs
        that needs the Triton beam kernel, whose graphs take rows of every level in one
        shape (negative own slots); the FlashInfer cascade's do not, so there it is off. By
        default (None) on exactly where merged graphs run: eagerly, merging saves only the
        Python overhead of a forward, measured on no device."""
        self.max_rows = ecfg.max_wave_rows
        self._versions: dict[int, CatalogVersion] = {}  # catalog versions with waves or graphs
        self._in_flight: Counter[int] = Counter()
        self._eager_padding: Callable[[list[int]], int] | None = None  # see eager_steps
        self._timeline: list[tuple[str, torch.cuda.Event]] | None = None  # see recording

    @contextmanager
    def eager_steps(
        self, pad_to: Callable[[list[int]], int] | None = None
    ) -> Iterator[None]:  # fmt: skip
        """Beam steps and prefills run eagerly inside the block (graphs off), each wave padded
        to `pad_to(widths)` requests when given: the graph path's padding without its replays
        (tests and diagnostics that name which path diverged)."""
        graphs, prefill, padding = self.graphs, self.prefill_graphs, self._eager_padding
        self.graphs, self.prefill_graphs, self._eager_padding = None, None, pad_to
        try:
            yield
        finally:
            self.graphs, self.prefill_graphs, self._eager_padding = graphs, prefill, padding

    @contextmanager
    def recording(self) -> Iterator[list[tuple[str, torch.cuda.Event]]]:
        """A CUDA event at each stage boundary (prefill, decode1, ...) of the waves run inside
        the block, appended to the list it yields (benchmarks on CUDA)."""
        marks: list[tuple[str, torch.cuda.Event]] = []
        self._timeline = marks
        try:
            yield marks
        finally:
            self._timeline = None

    @property
    def depth(self) -> int:
        return self.trie.depth

    def _mark(self, name: str) -> None:
        if self._timeline is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._timeline.append((name, event))

    def run(self, requests: list[GenerationRequest]) -> WaveOutput:
        state = self.begin(requests)
        ok = False
        try:
            while state.level < self.depth:
                self.advance(state)
            out = self.output(state)
            ok = True
            return out
        finally:
            self.release(state, ok)

    def begin(
        self, requests: list[GenerationRequest], token_budget: int | None = None
    ) -> WaveState:
        """Allocate the wave's KV and run its prefill, or (`token_budget`) its first forwards of
        about that many new tokens: `prefill_some` runs the rest. The first selection follows
        the last forward (`state.level` is then 1). On any error (a pool too small, say)
        everything taken so far is handed back before the error propagates."""
        state = self._allocated_wave(requests)
        self.prefill_or_release(state, token_budget)
        return state

    def prefill_or_release(self, state: WaveState, token_budget: int | None = None) -> None:
        """`prefill_some`; on any error the wave's KV is handed back before the error
        propagates (`begin`, and the prefill `begin_mixed` left to its caller)."""
        try:
            self.prefill_some(state, token_budget)
        except BaseException:
            self.release(state, False)
            raise

    def _allocated_wave(self, requests: list[GenerationRequest]) -> WaveState:
        """A new wave bound to its catalog version, its KV allocated and its prefill forwards
        planned (none run yet); on an error what was taken is handed back."""
        state = WaveState(list(requests), [], [], [], [], torch.empty(0, 0, dtype=torch.int64))
        self._bind_catalog(state)
        try:
            self._allocate(state)
            self._start_prefill(state)
        except BaseException:
            self.release(state, False)
            raise
        return state

    def _bind_catalog(self, state: WaveState) -> None:
        """The wave's catalog version (every request of a wave has the same one), its trie on
        the device and its graph variant; without one, the default trie of this BeamWave."""
        version = state.requests[0].catalog if state.requests else None
        if version is None:
            state.trie, state.index = self.trie, self.catalog_index
            return
        state.version, state.index = version, version.index
        state.variant = self._variant(version)
        state.trie = state.variant.trie
        self._versions[version.version] = version
        self._in_flight[version.version] += 1

    def _variant(self, version: CatalogVersion) -> GraphVariant:
        """The graphs' key and device trie of a catalog version."""
        return GraphVariant(version.version, version.trie(self.runner.device))

    def _sweep_versions(self) -> None:
        """Forget replaced catalog versions once no wave uses them: their graphs and their
        device trie go (the memory is freed)."""
        swept = False
        for key, version in list(self._versions.items()):
            if version.retired and self._in_flight[key] == 0:
                if self.graphs is not None:
                    self.graphs.forget(key)
                version.drop_device_trie()
                del self._versions[key], self._in_flight[key]
                swept = True
        if swept:  # finished requests and futures form cycles: free the host side now too
            gc.collect()

    def _allocate(self, state: WaveState) -> None:
        """Match and lock every prompt's cached prefix, make room for the whole wave at once
        (one eviction pass, not one per request), then take the slots."""
        table, cache, allocator = (
            self.runner.request_table,
            self.runner.prefix_cache,
            self.runner.allocator,
        )
        cached_slots = []
        for req in state.requests:
            cached, node = torch.empty(0, dtype=torch.int64), None
            if cache is not None:  # at least the last prompt token is computed
                cached, node = cache.match(req.prompt_ids, len(req.prompt_ids) - 1)
                cache.lock(node)
            state.locked.append(node)
            state.cached_lens.append(cached.numel())
            cached_slots.append(cached)
        num_rows = sum(r.n for r in state.requests)
        need = num_rows * (self.depth - 1) + sum(
            len(r.prompt_ids) - c.numel() for r, c in zip(state.requests, cached_slots)
        )
        if cache is not None and allocator.num_free < need:
            cache.evict(need - allocator.num_free)
        for req, cached in zip(state.requests, cached_slots):
            new = allocator.alloc(len(req.prompt_ids) - cached.numel())
            state.prompt_slots.append(torch.cat([cached, new]))
            state.table_rows.append(table.add(state.prompt_slots[-1]))
        state.decode_slots = allocator.alloc(num_rows * (self.depth - 1)).view(num_rows, -1)

    def release(self, state: WaveState, done: bool) -> None:
        """Hand a wave's KV back: after a finished wave its prompt slots go to the prefix cache,
        otherwise (or without a cache) the newly computed ones are freed; cached prefixes are
        unlocked and request-table rows removed either way. Safe on a partly built state."""
        self._release_requests(state, range(len(state.locked)), done)
        self.runner.allocator.free(state.decode_slots.flatten())
        if state.version is not None:
            self._in_flight[state.version.version] -= 1
            state.version = None
        self._sweep_versions()
        state.decode_slots = state.decode_slots[:0]
        state.requests, state.table_rows, state.prompt_slots = [], [], []
        state.cached_lens, state.locked = [], []

    def _release_requests(self, state: WaveState, indices: Sequence[int], done: bool) -> None:
        """Hand back what requests `indices` hold; a request's lists may stop short (a state
        whose allocation failed part way)."""
        cache, allocator = self.runner.prefix_cache, self.runner.allocator
        for i in indices:
            if i < len(state.prompt_slots):
                req, slots, cached = state.requests[i], state.prompt_slots[i], state.cached_lens[i]
                if cache is not None and done and i < len(state.table_rows):
                    cache.insert(req.prompt_ids, slots)
                else:
                    allocator.free(slots[cached:])
            if i < len(state.table_rows):
                self.runner.request_table.remove(state.table_rows[i])
            if i < len(state.locked) and state.locked[i] is not None:
                assert cache is not None, "only a cache locks nodes"
                cache.unlock(state.locked[i])

    def drop(self, state: WaveState, keep: list[bool]) -> None:
        """Take the requests with keep[i] False out of the wave between steps: their rows leave
        every beam tensor and their KV slots, table rows and prefix locks are handed back."""
        if all(keep):
            return
        assert state.prefill is None, "requests leave a wave only between beam steps"
        gone = [i for i, k in enumerate(keep) if not k]
        widths = [r.n for r in state.requests]
        offsets = [0, *itertools.accumulate(widths)]
        rows = torch.cat(
            [torch.arange(offsets[i], offsets[i + 1]) for i, k in enumerate(keep) if k]
            or [torch.empty(0, dtype=torch.int64)]
        )
        gone_rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in gone])
        self._release_requests(state, gone, done=False)
        self.runner.allocator.free(state.decode_slots[gone_rows].flatten())

        def pick(values: list) -> list:
            return [v for v, k in zip(values, keep) if k]

        state.requests, state.table_rows = pick(state.requests), pick(state.table_rows)
        state.prompt_slots, state.cached_lens = pick(state.prompt_slots), pick(state.cached_lens)
        state.locked = pick(state.locked)
        state.decode_slots = state.decode_slots[rows]
        state.shapes.clear()  # rows and prompts changed
        if not state.requests or state.sel is None:
            return
        dev = rows.to(self.runner.device, non_blocking=True)
        sel = state.sel
        state.sel = Selection(sel.parent[dev], sel.code[dev], sel.node[dev], sel.score[dev])
        state.codes, state.history = state.codes[dev], state.history[dev]
        state.path_scores = state.path_scores[dev]
        state.device_slots = state.device_slots[dev]
        state.layout = BeamLayout.create([r.n for r in state.requests], self.runner.device)
        state.prompts = torch.cat(state.prompt_slots).to(self.runner.device, non_blocking=True)
        state.noise = NoiseSource(state.requests, self.runner.device)
        if state.masks is not None:
            kept = [i for i, k in enumerate(keep) if k]
            state.masks = state.masks.select(torch.tensor(kept, device=self.runner.device))

    def _start_prefill(self, state: WaveState) -> None:
        """Plan the wave's prefill forwards: at most `prefill_chunk_tokens` new tokens each
        (engine/scheduler.py `prefill_chunks`). Activations grow with a forward's tokens: in one
        forward, 160 prompts of 960 new tokens of the bench preset hold 3.8 GB in the MLP's
        gate-up output alone. A chunk of up to 16 requests that fits a prefill graph replays
        it: a 160-request wave is 19 replays, not 19 x 400 launches from Python (which, in a
        server, compete for the GIL with the HTTP thread)."""
        requests = state.requests
        if state.index is None and any(r.item_filter is not None for r in requests):
            raise ValueError("item filters need a catalog (--catalog)")
        prompts = [list(r.prompt_ids) for r in requests]
        lengths = [len(p) for p in prompts]
        chunks = prefill_chunks(lengths, state.cached_lens, self.prefill_chunk_tokens)
        state.prefill = PrefillProgress(prompts, lengths, deque(chunks))
        self._mark("start")

    def prefill_some(self, state: WaveState, token_budget: int | None = None) -> bool:
        """Run the wave's next prefill forwards: all of them, or (`token_budget`) as many as
        fit about that many new tokens, at least one. After the last, the first selection.
        Whether the prefill is done. The caller releases the state on an error, as `begin`."""
        progress = state.prefill
        assert progress is not None, "a wave from begin whose prefill is not done"
        if not self.prefill_forwards(progress, state.prompt_slots, token_budget):
            return False
        parts, state.prefill = progress.parts, None
        self._first_selection(state, parts[0] if len(parts) == 1 else torch.cat(parts))
        return True

    def prefill_forwards(
        self,
        progress: PrefillProgress,
        prompt_slots: list[torch.Tensor],
        token_budget: int | None = None,
    ) -> bool:
        """Run `progress`'s next forwards (all, or about `token_budget` new tokens, at least
        one) over each prompt's KV slots; whether none is left. The last-token hidden states
        collect in `progress.parts`."""
        spent = 0
        while progress.chunks and (token_budget is None or spent < token_budget or not spent):
            chunk = progress.chunks.popleft()
            step = _prefill_step(progress, prompt_slots, chunk)
            done = [i for i, (r, _, end) in enumerate(chunk) if end == progress.lengths[r]]
            progress.parts.append(self._prefill_forward(step, done))
            spent += sum(end - start for _, start, end in chunk)
        return not progress.chunks

    @property
    def mixes_prefills(self) -> bool:
        """Whether an admitted wave's prefill can carry the beam steps of the waves in flight
        (`begin_mixed`): where both run eagerly, or with CUDA graphs of mixed steps
        (`DecodeGraphs.run_mixed`: merged steps on graphs, prefill graphs, and
        `mixed_prefill_tokens`; docs/architecture.md, "The latency tail under load")."""
        if self.graphs is None:
            return self.prefill_graphs is None
        return self.merge_steps and self.prefill_graphs is not None and self.graphs.mixed_tokens > 0

    def begin_mixed(
        self, requests: list[GenerationRequest], beside: Sequence[WaveState]
    ) -> tuple[WaveState, bool]:
        """`begin` (the whole prefill), with one beam step of every wave in `beside` through
        the prefill's forward when that is one forward (`ModelRunner.forward_segments`, or a
        mixed graph, `DecodeGraphs.run_mixed`): the weights are read once for both. Returns
        the new wave and whether `beside` stepped. When they did not (a prefill of several
        forwards, or no graph for this mix), nothing has run: the caller steps `beside` first,
        so that their step and their finished beams' copies are queued before the prefill,
        then runs it (`prefill_or_release`). On an error the new wave's KV is handed back and
        none of `beside` has stepped."""
        state = self._allocated_wave(requests)
        try:
            progress = state.prefill
            assert progress is not None, "a wave whose prefill has not run"
            mixed = None
            if len(progress.chunks) == 1 and beside:
                prefill = _prefill_step(progress, state.prompt_slots, progress.chunks[0])
                last = (prefill.qo_indptr[1:] - 1).to(self.runner.device, non_blocking=True)
                mixed = self._mixed_forward(prefill, last, beside)
            if mixed is None:  # several forwards, or no graph for this mix: apart
                return state, False
            first, parts, sels = mixed
            progress.chunks.popleft()
            state.prefill = None  # every prompt ends in its one forward: all last tokens
            self._first_selection(state, first)
        except BaseException:
            self.release(state, False)
            raise
        for wave, p, sel in zip(beside, parts, sels):
            self._advanced(wave, p, sel)
        return state, True

    def _mixed_forward(
        self, prefill: StepInput, last: torch.Tensor, beside: Sequence[WaveState]
    ) -> tuple[torch.Tensor, list[_StepParts], list[Selection]] | None:
        """The prefill and one beam step of the waves `beside` (one group of `step_groups`: one
        width and catalog version where graphs run) through one forward: the prefill's hidden
        states at `last`, each wave's step parts and selection; None when the mix has no CUDA
        graph (the caller runs them apart). Nothing of `beside` is updated yet."""
        if self.graphs is None:  # eagerly: a segmented forward, then each selection
            parts = [self._step_parts(wave, pad=False) for wave in beside]
            hidden = self.runner.forward_segments(
                [prefill, concat_beam_steps([p.step for p in parts])]
            )
            sels = self._select_steps(beside, parts, hidden, prefill.input_ids.numel())
            return hidden[last], parts, sels
        if any(self._graph_merge_rows(wave) is None for wave in beside):
            return None  # a wave that steps alone: no merged graph takes it
        parts = [self._step_parts(wave, pad=True) for wave in beside]
        merged = [
            MergedPart(wave.level, p.step, p.sel.score, p.sel.node, p.beams, wave.masks)
            for wave, p in zip(beside, parts)
        ]  # fmt: skip
        out = self.graphs.run_mixed(prefill, last, merged, self.depth - 1, beside[0].variant)
        return None if out is None else (out[0], parts, out[1])

    def _first_selection(self, state: WaveState, hidden: torch.Tensor) -> None:
        """Level 0 from the prompts' last hidden states. The prefill's last forward is queued
        already: the host work here (noise source, filter masks, beam layouts, small uploads)
        overlaps it on the GPU (an unloaded request's GPU sat idle ~1.4 ms while it ran first:
        docs/benchmarks.md, session 19)."""
        device, requests = self.runner.device, state.requests
        state.noise = NoiseSource(requests, device)
        if state.index is not None:
            filters = [r.item_filter for r in requests]
            state.masks = FilterMasks.create(filters, state.index, state.trie, device)
        first = BeamLayout.create([1] * len(requests), device)
        state.layout = BeamLayout.create([r.n for r in requests], device)
        zeros = torch.zeros(len(requests), device=device)
        nodes = torch.zeros(len(requests), dtype=torch.int64, device=device)
        state.sel = self._select(
            hidden, 0, zeros, nodes, first, state.layout, state.noise, state.masks, state.trie
        )
        state.codes = state.sel.code[:, None]
        state.path_scores = state.sel.score[:, None]
        state.device_slots = state.decode_slots.to(device, non_blocking=True)
        state.history = state.device_slots[:, :0]
        state.prompts = torch.cat(state.prompt_slots).to(device, non_blocking=True)  # once
        state.level = 1
        self._mark("prefill")

    def _prefill_forward(self, step: StepInput, sequences: list[int]) -> torch.Tensor:
        """Hidden states of the last token of the step's `sequences` (those whose prompt ends
        in this step): by graph replay for small prefills."""
        ends = step.qo_indptr[1:] - 1
        last = ends[sequences].to(self.runner.device, non_blocking=True)
        if self.prefill_graphs is not None:
            hidden = self.prefill_graphs.run(step, last)
            if hidden is not None:
                return hidden
        return self.runner.forward(step)[last]

    def advance(self, state: WaveState) -> None:
        """One beam step (level state.level), by graph replay where the wave's shape allows."""
        parts = self._step_parts(state, pad=True)
        if self.graphs is not None and parts.padded is not None:
            sel = self.graphs.run(
                state.level, parts.step, parts.sel.score, parts.sel.node, parts.beams,
                state.variant, state.masks,
            )  # fmt: skip
        else:
            if self.graphs is not None:
                self.graphs.count_eager(1)
            sel = self._select_step(state, parts, self.runner.forward(parts.step))
        self._advanced(state, parts, sel)

    def advance_together(self, states: Sequence[WaveState]) -> None:
        """One beam step of every wave in `states` (a group of `step_groups`) through one model
        forward over all their rows, then each wave's own selection on its rows: the weights
        are read once per iteration, not once per wave (each forward of a few rows is bound by
        that read). The waves may be at different levels. With CUDA graphs the whole merged
        step is one replay (`DecodeGraphs.run_merged`); a shape whose capture failed steps
        each wave alone."""
        if len(states) == 1:
            self.advance(states[0])
            return
        if self.graphs is not None:
            parts = [self._step_parts(state, pad=True) for state in states]
            merged = [
                MergedPart(state.level, p.step, p.sel.score, p.sel.node, p.beams, state.masks)
                for state, p in zip(states, parts)
            ]  # fmt: skip
            sels = self.graphs.run_merged(merged, self.depth - 1, states[0].variant)
            if sels is None:
                for state in states:
                    self.advance(state)
                return
        else:
            parts = [self._step_parts(state, pad=False) for state in states]
            hidden = self.runner.forward(concat_beam_steps([p.step for p in parts]))
            sels = self._select_steps(states, parts, hidden, 0)
        for state, p, sel in zip(states, parts, sels):
            self._advanced(state, p, sel)

    def step_groups(self, states: Sequence[WaveState]) -> list[list[int]]:
        """The waves (indices into `states`) whose beam steps share a forward: with
        `merge_steps`, waves in order while their rows fit `max_wave_rows` together (the
        activations and graph buffers are sized for that); with CUDA graphs only small greedy
        waves of one n and one catalog version (`cuda_graph.merged_rows`: one merged graph
        takes them, pad rows counted), every other wave alone, replaying its own step graph.
        Without `merge_steps`, each wave alone."""
        if not self.merge_steps:
            return [[i] for i in range(len(states))]
        groups: list[list[int]] = []
        open_groups: dict[tuple[int, int], tuple[list[int], int]] = {}  # key -> (group, rows)
        for i, state in enumerate(states):
            widths = [r.n for r in state.requests]
            key, wave_rows = (0, 0), sum(widths)
            if self.graphs is not None:
                rows = self._graph_merge_rows(state)
                if rows is None:
                    groups.append([i])
                    continue
                key = (widths[0], state.variant.key if state.variant is not None else 0)
                wave_rows = rows
            group, rows = open_groups.get(key, ([], 0))
            if not group or rows + wave_rows > self.max_rows:
                group, rows = [], 0
                groups.append(group)
            group.append(i)
            open_groups[key] = (group, rows + wave_rows)
        return groups

    def _graph_merge_rows(self, state: WaveState) -> int | None:
        """The rows the wave takes in a merged step graph (pad rows counted), or None: it
        steps alone, replaying its own step graph (`cuda_graph.merged_rows`)."""
        assert self.graphs is not None, "merged step graphs"
        widths = [r.n for r in state.requests]
        sampling = state.noise is not None and state.noise.sampling
        padded = self.graphs.padded_requests(widths, sampling, state.masks)
        return merged_rows(padded, widths[0], self.max_rows)

    def capture_merged_steps(self, width: int, version: CatalogVersion | None = None) -> int:
        """Capture the merged step graphs traffic at `width` meets (`merged_shapes`), on the
        trie of catalog `version` (None: the default), unfiltered and, where the catalog has
        an item index, with every wave filtered; how many graphs. Nothing without merged
        steps on CUDA graphs."""
        if self.graphs is None or not self.merge_steps:
            return 0
        variant = self._variant(version) if version is not None else None
        trie = variant.trie if variant is not None else self.trie
        index = version.index if version is not None else self.catalog_index
        filters = None
        if index is not None:  # masks of no request: the buffers' shapes, nothing to copy
            template = FilterMasks.create([index.allow_all()], index, trie, self.runner.device)
            assert template is not None, "one filter gives masks"
            filters = template.select(torch.zeros(0, dtype=torch.int64, device=self.runner.device))
        shapes = merged_shapes(width, self.depth, self.max_rows)
        self.graphs.capture_merged(width, shapes, self.depth - 1, variant, filters)
        return len(shapes) * (2 if filters is not None else 1)

    def capture_mixed_steps(self, width: int, version: CatalogVersion | None = None) -> int:
        """Capture the mixed graphs (`DecodeGraphs.capture_mixed`) of one or more waves at
        `width` on catalog `version`'s trie (None: the default): every mixed prefill bucket
        with the step shapes of `merged_shapes(min_waves=1)` (at most `MAX_MIXED_STEP_SHAPES`);
        how many. Nothing where prefills do not mix through graphs."""
        if self.graphs is None or not self.mixes_prefills:
            return 0
        variant = self._variant(version) if version is not None else None
        shapes = merged_shapes(width, self.depth, self.max_rows, 1, MAX_MIXED_STEP_SHAPES)
        return self.graphs.capture_mixed(width, shapes, self.depth - 1, variant)

    def _step_parts(self, state: WaveState, pad: bool) -> _StepParts:
        """The wave's inputs of its next beam step; with `pad`, padded to the graph shape it
        replays (if any)."""
        assert state.sel is not None and 0 < state.level < self.depth, "a wave in flight"
        level, real = state.level, state.layout
        widths = [r.n for r in state.requests]
        padded = self._padded_requests(widths, state.noise.sampling, state.masks) if pad else None
        num_pad = (padded - len(widths)) if padded is not None else 0
        shape = state.shapes.get(num_pad)
        if shape is None:
            prompt_lens = [len(r.prompt_ids) for r in state.requests]
            shape = StepShape.create(
                widths, prompt_lens, state.prompts, num_pad, self.runner.device
            )
            state.shapes[num_pad] = shape
        pad_rows = shape.pad
        own = pad_rows.slots(state.device_slots[:, level - 1])
        history = pad_rows.slots(state.history)
        step = prepare_beam_decode(
            tokens=self.sid.level_starts[level - 1] + pad_rows.slots(state.codes[:, -1], 0),
            positions=shape.row_prompt_len + level - 1, prompts=shape.prompts,
            prompt_lens=shape.prompt_lens, row_request=shape.row_request, history=history,
            own=own,
        )  # fmt: skip
        beams = shape.beams if num_pad else real
        return _StepParts(step, beams, pad_rows.selection(state.sel), own, history, padded)

    def _select_steps(
        self,
        states: Sequence[WaveState],
        parts: Sequence[_StepParts],
        hidden: torch.Tensor,
        start: int,
    ) -> list[Selection]:
        """Each wave's selection on its rows of a forward that ran their steps back to back
        from row `start` (`concat_beam_steps`)."""
        sels = []
        for state, p in zip(states, parts):
            rows = p.beams.num_rows
            sels.append(self._select_step(state, p, hidden[start : start + rows]))
            start += rows
        return sels

    def _select_step(self, state: WaveState, parts: _StepParts, hidden: torch.Tensor) -> Selection:
        return self._select(
            hidden, state.level, parts.sel.score, parts.sel.node, parts.beams, parts.beams,
            state.noise, state.masks, state.trie,
        )  # fmt: skip

    def _advanced(self, state: WaveState, parts: _StepParts, sel: Selection) -> None:
        """The wave after its step's selection `sel` (pad rows dropped): every beam's history,
        codes and path scores follow its parent."""
        level = state.level
        rows = state.layout.num_rows  # real rows come first and never pick a pad row as parent
        parent = sel.parent[:rows]
        state.history = torch.cat([parts.history, parts.own[:, None]], dim=1)[parent]
        state.codes = torch.cat([state.codes[parent], sel.code[:rows, None]], dim=1)
        state.path_scores = torch.cat([state.path_scores[parent], sel.score[:rows, None]], dim=1)
        state.sel = Selection(parent, sel.code[:rows], sel.node[:rows], sel.score[:rows])
        state.level += 1
        self._mark(f"decode{level}")

    def _padded_requests(
        self, widths: list[int], sampling: bool, masks: FilterMasks | None
    ) -> int | None:
        if self.graphs is not None:
            return self.graphs.padded_requests(widths, sampling, masks)
        if masks is not None:  # filter masks hold one row per real request: no pad requests
            return None
        if self._eager_padding is not None and not sampling:
            return self._eager_padding(widths)
        return None

    def output(self, state: WaveState) -> WaveOutput:
        assert state.level == self.depth and state.sel is not None, "the wave has finished"
        return WaveOutput(
            state.layout, state.codes, state.sel.score, state.sel.node, state.path_scores
        )

    def _select(
        self,
        hidden: torch.Tensor,
        level: int,
        parent_score: torch.Tensor,
        nodes: torch.Tensor,
        parents: BeamLayout,
        out: BeamLayout,
        noise: NoiseSource,
        masks: FilterMasks | None,
        trie: Trie,
    ) -> Selection:
        draw = noise.draw(parents, trie.max_children(level))
        return self.selector.select(
            trie, level, hidden, parent_score, nodes, parents, out, draw, masks
        )


def _prefill_step(
    progress: PrefillProgress, prompt_slots: list[torch.Tensor], chunk: list[Piece]
) -> StepInput:
    """The prefill forward of one chunk of pieces (engine/scheduler.py `prefill_chunks`).
    Host slots (state.prompt_slots), not the device table: reading it back would be one
    device-to-host sync per request. Every upload is non-blocking likewise."""
    reqs = [r for r, _, _ in chunk]
    return prepare_prefill(
        [progress.prompts[r] for r in reqs], [prompt_slots[r] for r in reqs],
        [start for _, start, _ in chunk], [end for _, _, end in chunk],
    )  # fmt: skip
