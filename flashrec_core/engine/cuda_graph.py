"""Whole-step CUDA graphs for beam decode steps.

One replay covers a whole beam step: model forward, then `BeamSelector.select` (restricted LM
head, filter masks, trie mask, top-k and beam expansion: the new parent, code, node and score of
every row). The runner owns its selector, input buffers and mask buffers; it never calls back
into the search loop. What stays outside is the
attention plan (host scheduling into FlashInfer's fixed index buffers) and a few small copies.

Shapes. A graph is captured per (level, padded request count, beam width): the head's codebook
slice and the trie table differ per level, and selection is per request. A wave of B requests of
width n is padded to the next capture size with pad requests of n rows each. Pad rows read and
write only the pad slot (`KVPool.PAD_SLOT`) and start with score -inf, so their beams die and never
touch a real request's selection (selection never crosses requests).

Per-request item filters are graph inputs too: a filtered wave replays its own graph (key flag
`filtered`), which reads the level's allowed-children mask from a buffer the wave's mask is copied
into before each replay (one buffer per catalog version, level and width, sized for the largest
request count; pad requests' rows are all-allowed and their beams die anyway).

Gating is decided per wave, before anything is captured: sampling waves (per-request generators),
mixed widths, waves over the largest size and filtered waves whose mask buffer would exceed
`MASK_BUFFER_BYTES` run eagerly, and every eager step is counted and its reason logged once.
Capture happens on first use of a shape; the server's warm-up (and its catalog reloads) and
`flashrec bench` run each wave shape first so that traffic sees replays only.

Merged steps (`merge_beam_steps`). Small waves in flight at once (each padded to a capture size
of at most `MERGE_MAX_REQUESTS` requests and `MERGE_MAX_ROWS` rows) step through one graph: one
model forward over all their rows, then each wave's own selection on its rows (a filtered wave's
through its level's mask buffer, as alone), all captured, keyed by the (level, padded request
count) of every wave in order and which waves are filtered. Such a forward is bound by
reading the weights (a 50-row forward's GEMMs take 1.88 ms on an H100, a 512-row one's 2.25),
so two waves pay for about one read instead of two; a larger wave's forward is bound by its
own rows and steps alone. `merged_shapes` lists the shapes the server's warm-up captures.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flashrec_core.attention.segments import SegmentedAttention
from flashrec_core.engine.beam_inputs import concat_beam_steps, pad_requests_step
from flashrec_core.engine.graph_capture import record_graph
from flashrec_core.engine.prefill_graph import (
    MIXED_SEQUENCES,
    empty_prefill,
    fits_prefill_graph,
    mixed_prefill_shape,
    mixed_token_buckets,
    pad_prefill,
)
from flashrec_core.search.beam import NEG_INF, BeamLayout, Selection
from flashrec_core.search.filters import FilterMasks
from flashrec_core.search.selector import BeamSelector
from flashrec_core.search.trie import Trie

if TYPE_CHECKING:
    from flashrec_core.attention.flashinfer import GraphAttention
    from flashrec_core.engine.model_runner import ModelRunner, StepInput

logger = logging.getLogger("flashrec")

MERGE_MAX_REQUESTS = 8
MERGE_MAX_ROWS = 512
"""The largest wave (padded requests, beam rows) a merged step graph takes. Below 512 rows a
forward's FP8 GEMMs cost about the same whatever the rows (docs/benchmarks.md, session 22:
1.88 ms at 50 rows, 2.25 ms at 512 on an H100), so waves this small gain from sharing one;
the request cap keeps the shapes the warm-up captures few."""

MAX_MERGED_SHAPES = 64
"""The most merged shapes `merged_shapes` lists for a warm-up (the request ladder is cut until
its combinations fit): each is a graph capture of a forward and its selections."""

MAX_MIXED_STEP_SHAPES = 16
"""The most step shapes (one or more waves) the warm-up captures mixed graphs for, at each of
the mixed prefill buckets: at n=50 and depth 3, every level set at 1, 2 and 4 requests a wave
(15 shapes, 45 graphs with three buckets, about 6 s on an H100). Others capture on first use."""

MASK_BUFFER_BYTES = 1 << 30
"""Largest filter-mask buffer (one per catalog version, level and width) a graph may read; a
filtered wave whose buffer would be larger (a huge catalog at a small n) runs eagerly."""


class GraphVariant(NamedTuple):
    """A trie the graphs bake in (a catalog version's), and the key its graphs are kept under
    (`forget(key)` drops them)."""

    key: int
    trie: Trie


def capture_request_counts(width: int, max_rows: int) -> list[int]:
    """Request counts a graph is captured for at beam width `width`: 1, 2, 4, then every multiple
    of 8, up to the most that fit `max_rows` (also captured, so a full wave is never padded)."""
    most = max_rows // width
    ladder = [b for b in (1, 2, 4) if b <= most] + list(range(8, most + 1, 8))
    return sorted(set(ladder + [most])) if most >= 1 else []


def merge_counts(width: int, max_rows: int) -> list[int]:
    """The padded request counts a wave of `width` may have to step in a merged graph."""
    return [
        b for b in capture_request_counts(width, max_rows)
        if b <= MERGE_MAX_REQUESTS and b * width <= MERGE_MAX_ROWS
    ]  # fmt: skip


def merged_rows(padded: int | None, width: int, max_rows: int) -> int | None:
    """The rows a wave of `width` padded to `padded` requests (`DecodeGraphs.padded_requests`:
    None for a wave that runs eagerly) takes in a merged step graph, or None: it steps alone.
    Only waves padded to a count of `merge_counts` merge."""
    if padded is None or padded not in _merge_count_set(width, max_rows):
        return None
    return padded * width


@functools.cache
def _merge_count_set(width: int, max_rows: int) -> frozenset[int]:
    """`merge_counts` as a set, built once per (width, budget): `merged_rows` asks it for every
    wave in flight at every step boundary."""
    return frozenset(merge_counts(width, max_rows))


MergedShape = tuple[tuple[int, int], ...]
"""(level, padded request count) of each wave of a merged step, oldest wave first."""

_MergedKey = tuple[int, int, MergedShape, tuple[bool, ...], tuple[int, int] | None]
"""A merged graph's key: catalog variant, beam width, shape, which parts are filtered, and the
(tokens, sequences) of a mixed step's prefill (None: a merged step alone)."""


def merged_shapes(
    width: int, depth: int, max_rows: int, min_waves: int = 2, most: int = MAX_MERGED_SHAPES
) -> list[MergedShape]:
    """The merged shapes a server's traffic meets at `width`: every set of `min_waves` or more
    distinct levels (the loop admits at most one wave per iteration, so the waves in flight sit
    at distinct levels), deepest (oldest) first, at every count of `merge_counts` each; the
    largest counts are dropped until they fit `most`. (`min_waves=1`: the step shapes of mixed
    graphs, where one wave's step rides in a prefill's forward too.)"""
    counts = merge_counts(width, max_rows)
    levels = range(depth - 1, 0, -1)
    while counts:
        shapes: list[MergedShape] = []
        for size in range(min_waves, depth):
            for chosen in itertools.combinations(levels, size):
                for picked in itertools.product(counts, repeat=size):
                    shapes.append(tuple(zip(chosen, picked)))
        if len(shapes) <= most:
            return shapes
        counts = counts[:-1]
    return []


def graph_padding(widths: list[int], sampling: bool, max_rows: int) -> tuple[int | None, str]:
    """(request count of the graph a wave of these beam widths replays, "") or (None, why the
    wave runs eagerly). Decided per wave, before anything is captured."""
    if sampling:
        return None, "sampling (temperature > 0) draws per-request noise on the host"
    if len(set(widths)) != 1:
        return None, "requests of one wave ask for different n"
    fits = [b for b in capture_request_counts(widths[0], max_rows) if b >= len(widths)]
    if not fits:
        return None, f"{len(widths)} x {widths[0]} rows exceed max_wave_rows {max_rows}"
    return fits[0], ""


def _execute(captured: _StepGraph | _MergedGraph, replay: bool) -> Any:
    """A captured step's output: by replay, or (tests) its captured work run eagerly on the same
    buffers."""
    if not replay:
        return captured.body()
    captured.graph.replay()
    return captured.output


def _owned(sel: Selection) -> Selection:
    """A copy of a graph's output selection that the next replay cannot overwrite."""
    return Selection(sel.parent.clone(), sel.code.clone(), sel.node.clone(), sel.score.clone())


def _owned_output(output: _MergedOutput) -> _MergedOutput:
    """A merged graph's selections copied (`_owned`); a mixed step's prefill hidden states are
    left in the graph's memory, for `run_mixed` gathers the rows it needs at once."""
    hidden, sels = output
    return hidden, [_owned(sel) for sel in sels]


@dataclass
class GraphStats:
    replays: int = 0
    eager_steps: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    eager_reasons: Counter[str] = field(default_factory=Counter)
    merged_replays: int = 0  # merged steps (several waves, one graph) replayed
    mixed_replays: int = 0  # prefills and a beam step in one graph (`run_mixed`) replayed


@dataclass(frozen=True)
class MergedPart:
    """One wave's share of a merged step: its level and its inputs padded to a capture count
    (`beam_wave._StepParts` with pad=True)."""

    level: int
    step: StepInput
    score: torch.Tensor  # [rows] the parents' path scores
    node: torch.Tensor  # [rows] the parents' trie nodes
    layout: BeamLayout  # the rows, pad requests included
    masks: FilterMasks | None = None  # the wave's item-filter masks (its real requests' rows)


@dataclass(frozen=True)
class _MixedPrefill:
    """The prefill of a mixed step, padded to its graph's (tokens, sequences)."""

    shape: tuple[int, int]
    step: StepInput


_MergedOutput = tuple[torch.Tensor | None, list[Selection]]
"""A merged step's output: the prefill's hidden states (mixed steps; else None), then each
part's selection."""


@dataclass
class _MergedGraph:
    """A merged step at one `MergedShape`, after a prefill's tokens in a mixed step: one
    forward, then each part's selection."""

    graph: torch.cuda.CUDAGraph
    attention: GraphAttention
    prefill_attention: Any  # the prefill segment's graph attention (mixed steps), else None
    output: _MergedOutput
    body: Callable[[], _MergedOutput]  # the captured work, callable eagerly (tests)


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph
    attention: GraphAttention
    layout: BeamLayout
    output: Selection
    body: Callable[[], Selection]  # the captured work, callable eagerly on the same buffers


class DecodeGraphs:
    """Captured beam steps of one engine, sharing one memory pool and one set of input buffers."""

    def __init__(
        self, runner: ModelRunner, selector: BeamSelector, trie: Trie, max_rows: int,
        mixed_tokens: int = 0,
    ) -> None:  # fmt: skip
        """`mixed_tokens`: the most new prompt tokens of a prefill that carries a beam step
        (`run_mixed`; 0: none)."""
        self.runner = runner
        self.selector = selector
        self.default = GraphVariant(0, trie)  # steps that name no variant
        self.max_rows = max_rows
        self.mixed_tokens = mixed_tokens
        self.stats = GraphStats()
        # (variant, level, requests, width, filtered)
        self._graphs: dict[tuple[int, int, int, int, bool], _StepGraph] = {}
        self._failed: dict[tuple[int, int, int, int, bool], str] = {}  # why capture failed
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (variant, level, width)
        # (variant, width, shape, which parts are filtered, mixed prefill shape or None)
        self._merged: dict[_MergedKey, _MergedGraph] = {}
        self._merged_failed: dict[_MergedKey, str] = {}
        self._pool: Any = None  # the graphs' memory pool, made by the first capture
        dev, tokens = runner.device, max_rows + mixed_tokens  # a mixed step's prefill first
        with torch.inference_mode():
            self._ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
            self._pos = torch.zeros(tokens, dtype=torch.int64, device=dev)
            self._loc = torch.zeros(tokens, dtype=torch.int64, device=dev)
            self._score = torch.zeros(max_rows, dtype=torch.float32, device=dev)
            self._node = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self._logged: set[str] = set()
        self._eager_reason = ""  # why the last wave `padded_requests` turned down runs eagerly

    @classmethod
    def create(cls, runner: ModelRunner, selector: BeamSelector, trie: Trie) -> DecodeGraphs | None:
        """The engine's graphs, or None (logged) when this engine cannot capture steps."""
        cfg = runner.loaded.engine_config
        reason = None
        if not cfg.cuda_graphs:
            reason = "cuda_graphs=False"
        elif runner.device.type != "cuda":
            reason = f"device is {runner.device.type}"
        elif not runner.attn_backend.supports_graphs:
            reason = f"the {runner.attn_backend.name} attention backend cannot be captured"
        if reason is not None:
            logger.info("CUDA graphs off (%s): beam steps run eagerly", reason)
            return None
        mixed = 0  # a mixed step's prefill plans as a prefill graph does
        prefill_graphs = getattr(runner.attn_backend, "supports_prefill_graphs", False)
        if cfg.mixed_prefill_steps and prefill_graphs:
            mixed = min(cfg.mixed_prefill_tokens, cfg.prefill_graph_tokens)
        return cls(runner, selector, trie, cfg.max_wave_rows, mixed)

    def padded_requests(
        self, widths: list[int], sampling: bool, masks: FilterMasks | None = None
    ) -> int | None:
        """Requests of this wave once padded to a capture size, or None: run it eagerly (the
        reason is counted per step by `count_eager` and logged once)."""
        padded, self._eager_reason = graph_padding(widths, sampling, self.max_rows)
        if padded is not None and masks is not None:
            most = self.max_rows // widths[0]
            biggest = max(m.shape[1] for m in masks.levels) * most
            if biggest > MASK_BUFFER_BYTES:
                self._eager_reason = (
                    f"item filters at n={widths[0]} need a {biggest / 2**20:.0f} MiB mask "
                    f"buffer per level, over {MASK_BUFFER_BYTES / 2**20:.0f} MiB"
                )
                return None
        return padded

    def count_eager(self, steps: int) -> None:
        reason = self._eager_reason
        self.stats.eager_steps += steps
        self.stats.eager_reasons[reason] += steps
        self._log_once(f"beam steps run eagerly, without CUDA graphs: {reason}")

    def run(
        self, level: int, step: StepInput, score: torch.Tensor, node: torch.Tensor,
        layout: BeamLayout, variant: GraphVariant | None = None,
        masks: FilterMasks | None = None,
    ) -> Selection:  # fmt: skip
        """One beam step by graph replay (captured on first use of this shape and variant;
        no variant: the trie the graphs were created with, key 0). `masks`: the
        wave's filter masks (real requests' rows; the graph's pad rows allow everything)."""
        return self._step(level, step, score, node, layout, True, variant, masks)

    def run_uncaptured(
        self, level: int, step: StepInput, score: torch.Tensor, node: torch.Tensor,
        layout: BeamLayout, variant: GraphVariant | None = None,
        masks: FilterMasks | None = None,
    ) -> Selection:  # fmt: skip
        """The same step, same buffers and plan, executed eagerly instead of replayed: the
        reference a replay must equal exactly (tests)."""
        return self._step(level, step, score, node, layout, False, variant, masks)

    def run_merged(
        self, parts: Sequence[MergedPart], suffix_width: int, variant: GraphVariant | None,
        replay: bool = True,
    ) -> list[Selection] | None:  # fmt: skip
        """Each part's selection after one forward over all their rows, by replay of the graph
        of their shape (captured on first use); None when that shape's capture failed (the
        caller steps the waves alone). `suffix_width`: the most own slots a row carries
        (depth - 1). `replay=False` runs the same work eagerly on the same buffers (captured
        or not: the reference a replay must equal; tests)."""
        out = self._run_merged(parts, suffix_width, variant, replay, None)
        return None if out is None else out[1]

    def run_mixed(
        self, prefill: StepInput, last: torch.Tensor, parts: Sequence[MergedPart],
        suffix_width: int, variant: GraphVariant | None, replay: bool = True,
    ) -> tuple[torch.Tensor, list[Selection]] | None:  # fmt: skip
        """An admitted wave's prefill and one beam step of the waves `parts` in one replay:
        one forward over the prefill's tokens (padded to a mixed shape, `mixed_prefill_shape`)
        and then the parts' rows, each segment's attention planned as if alone
        (attention/segments.py), then each part's selection as `run_merged` does. The weights
        are read once for both (docs/architecture.md, "The latency tail under load"). Returns
        the hidden states at the prefill's token positions `last` (device indices) and each
        part's selection; None when the prefill has no mixed shape or the capture failed
        (the caller runs them apart). `replay=False` as in `run_merged`."""
        tokens, requests = prefill.input_ids.numel(), prefill.qo_indptr.numel() - 1
        shape = mixed_prefill_shape(tokens, requests, self.mixed_tokens)
        if shape is None:
            return None
        padded = _MixedPrefill(shape, pad_prefill(prefill, *shape))
        if not fits_prefill_graph(self.runner.attn_backend, padded.step, shape[0]):
            return None
        out = self._run_merged(parts, suffix_width, variant, replay, padded)
        if out is None:
            return None
        hidden, sels = out
        assert hidden is not None, "a mixed step returns its prefill's hidden states"
        return hidden[last], sels

    def _run_merged(
        self, parts: Sequence[MergedPart], suffix_width: int, variant: GraphVariant | None,
        replay: bool, prefill: _MixedPrefill | None,
    ) -> _MergedOutput | None:  # fmt: skip
        variant = variant or self.default
        width = parts[0].layout.max_width
        shape = tuple((p.level, p.layout.widths.numel()) for p in parts)
        filtered = tuple(p.masks is not None for p in parts)
        key = (variant.key, width, shape, filtered, prefill.shape if prefill else None)
        if key in self._merged_failed:
            return None
        filtered_levels = [p.level for p in parts if p.masks is not None]
        if len(set(filtered_levels)) < len(filtered_levels):
            return None  # two filtered waves at one level would share its mask buffer
        step = concat_beam_steps([p.step for p in parts])
        graph = self._merged.get(key)
        with torch.inference_mode():
            if prefill is not None:  # its tokens first, the step's rows after them
                self._copy_inputs(prefill.step)
            self._copy_inputs(step, prefill.shape[0] if prefill else 0)
            start = 0
            for p in parts:
                end = start + p.layout.num_rows
                self._score[start:end].copy_(p.score)
                self._node[start:end].copy_(p.node)
                start = end
            masks = [
                self._mask_input(variant.key, p.level, p.layout, p.masks)
                if p.masks is not None else None
                for p in parts
            ]  # fmt: skip
            if graph is None and not replay:  # the eager reference of a shape not captured
                *_, body = self._merged_body(
                    shape, step, parts, masks, variant.trie, suffix_width, prefill
                )
                return _owned_output(body())
            if graph is None:
                try:
                    graph = self._capture_merged(
                        key, step, parts, masks, variant.trie, suffix_width, prefill
                    )
                except (RuntimeError, ValueError) as exc:  # CUDA OOM / capture errors, limits
                    mixed = f" after a {prefill.shape} prefill" if prefill else ""
                    why = f"capture of merged step {shape} x {width}{mixed} failed: {exc}"
                    self._merged_failed[key] = why
                    self._log_once(f"these waves step apart: {why}")
                    return None
            else:
                self.runner.attn_backend.plan(step, graph=graph.attention)
                if prefill is not None:
                    self.runner.attn_backend.plan(prefill.step, graph=graph.prefill_attention)
            if prefill is None:
                self.stats.merged_replays += replay
            else:
                self.stats.mixed_replays += replay
            return _owned_output(_execute(graph, replay))

    def capture_merged(
        self, width: int, shapes: Sequence[MergedShape], suffix_width: int,
        variant: GraphVariant | None = None, filters: FilterMasks | None = None,
    ) -> None:  # fmt: skip
        """Capture the merged step graphs of `shapes` at `width` on `variant`'s trie from waves
        of pad requests (dead beams: they read and write only the pad slot), so traffic replays
        them (the server's warm-up). With `filters` (masks of no request, the catalog's level
        sizes) each shape is captured a second time with every wave filtered: traffic whose
        requests mostly carry filters merges too (waves mixing the two capture on first use)."""
        key = (variant or self.default).key
        for shape in shapes:
            for masks in [None] + ([filters] if filters is not None else []):
                if (key, width, shape, (masks is not None,) * len(shape), None) in self._merged:
                    continue
                self.run_merged(self._pad_parts(width, shape, masks), suffix_width, variant)

    def capture_mixed(
        self, width: int, shapes: Sequence[MergedShape], suffix_width: int,
        variant: GraphVariant | None = None,
    ) -> int:  # fmt: skip
        """Capture the mixed graphs (`run_mixed`) of every mixed prefill bucket with each of
        the step `shapes` at `width`, from a prefill of pad sequences and waves of pad
        requests, largest first (the graphs share one memory pool, see `warm_counts` in
        server/warmup.py); how many were captured. Filtered waves' mixed graphs capture on
        first use."""
        key, done = (variant or self.default).key, 0
        by_rows = sorted(shapes, key=lambda shape: -sum(count for _, count in shape))
        for tokens in reversed(mixed_token_buckets(self.mixed_tokens)):
            mixed = (tokens, MIXED_SEQUENCES)
            prefill = pad_prefill(empty_prefill(), *mixed)
            for shape in by_rows:
                if (key, width, shape, (False,) * len(shape), mixed) in self._merged:
                    continue
                parts = self._pad_parts(width, shape, None)
                done += self._run_merged(
                    parts, suffix_width, variant, True, _MixedPrefill(mixed, prefill)
                ) is not None  # fmt: skip
        return done

    def _pad_parts(
        self, width: int, shape: MergedShape, masks: FilterMasks | None
    ) -> list[MergedPart]:
        """Waves of pad requests (dead beams: they read and write only the pad slot) of
        `shape`, to capture a graph from."""
        dev, parts = self.runner.device, []
        for level, count in shape:
            layout = BeamLayout.create([width] * count, dev)
            rows = layout.num_rows
            score = torch.full((rows,), NEG_INF, dtype=torch.float32, device=dev)
            node = torch.zeros(rows, dtype=torch.int64, device=dev)
            step = pad_requests_step(count, width, dev)
            parts.append(MergedPart(level, step, score, node, layout, masks))
        return parts

    def _copy_inputs(self, step: StepInput, start: int = 0) -> None:
        """The step's tokens, positions and slots into the input buffers from row `start`."""
        end = start + step.input_ids.numel()
        self._ids[start:end].copy_(step.input_ids, non_blocking=True)
        self._pos[start:end].copy_(step.positions, non_blocking=True)
        self._loc[start:end].copy_(step.out_cache_loc, non_blocking=True)

    def _merged_body(
        self, shape: MergedShape, step: StepInput, parts: Sequence[MergedPart],
        masks: Sequence[FilterMasks | None], trie: Trie, suffix_width: int,
        prefill: _MixedPrefill | None,
    ) -> tuple[GraphAttention, Any, Callable[[], _MergedOutput]]:  # fmt: skip
        """A merged step's work on the graph buffers: its attention (planned for `step`), its
        prefill's (a mixed step; planned for `prefill.step`, else None) and the closure a
        capture records: a forward over the prefill's tokens, if any, then every part's rows,
        then each part's selection on its slice, filtered parts through their mask buffers
        `masks`."""
        backend = self.runner.attn_backend
        num_requests = sum(count for _, count in shape)
        rows = step.input_ids.numel()
        attention = backend.graph_attention(num_requests, rows, suffix_width=suffix_width)
        tokens, prefill_attention, segments = 0, None, None
        if prefill is None:
            metadata = backend.plan(step, graph=attention)
        else:  # the prefill's tokens first, then the step's rows
            tokens, sequences = prefill.shape
            prefill_attention = backend.prefill_graph_attention(sequences, tokens)
            segments = SegmentedAttention(backend)
            metadata = segments.plan([prefill.step, step], [prefill_attention, attention])
        bounds = list(itertools.accumulate((p.layout.num_rows for p in parts), initial=tokens))
        shares = [
            (p.level, p.layout, m, a, b, a - tokens, b - tokens)
            for p, m, a, b in zip(parts, masks, bounds, bounds[1:])
        ]  # fmt: skip
        total = tokens + rows

        def body() -> _MergedOutput:
            hidden = self.runner.forward_batch(
                self._ids[:total], self._pos[:total], self._loc[:total], metadata, segments
            )
            return (hidden[:tokens] if tokens else None), [
                self.selector.select(
                    trie, level, hidden[a:b], self._score[i:j], self._node[i:j], layout,
                    layout, None, m,
                )
                for level, layout, m, a, b, i, j in shares
            ]  # fmt: skip

        return attention, prefill_attention, body

    def _capture_merged(
        self, key: _MergedKey, step: StepInput, parts: Sequence[MergedPart],
        masks: Sequence[FilterMasks | None], trie: Trie, suffix_width: int,
        prefill: _MixedPrefill | None,
    ) -> _MergedGraph:  # fmt: skip
        _, width, shape, filtered, mixed = key
        start = time.perf_counter()
        attention, prefill_attention, body = self._merged_body(
            shape, step, parts, masks, trie, suffix_width, prefill
        )
        graph, outputs = record_graph(body, self._graph_pool())
        captured = _MergedGraph(graph, attention, prefill_attention, outputs, body)
        self._merged[key] = captured
        note = f", filtered {filtered}" if any(filtered) else ""
        what = "merged beam step" if mixed is None else f"mixed step: a {mixed} prefill, beam step"
        self._note_capture(start, f"{what}: (level, requests) {shape} x {width}{note}")
        return captured

    def _graph_pool(self) -> Any:
        """The memory pool every graph of this engine shares (made on first use, so that the
        eager reference of a merged step runs on a machine without CUDA: tests)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _note_capture(self, start: float, what: str) -> None:
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        logger.info("captured %s, in %.2f s", what, seconds)

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.warning(message)

    def forget(self, variant_key: int) -> None:
        """Drop the graphs and mask buffers of a variant (a catalog version no request uses
        any more)."""
        for table in (self._graphs, self._failed, self._masks, self._merged, self._merged_failed):
            for key in [k for k in table if k[0] == variant_key]:
                del table[key]

    def _mask_input(
        self, variant: int, level: int, layout: BeamLayout, masks: FilterMasks
    ) -> FilterMasks:
        """The graph's view of the filter masks at `level`: the wave's rows copied into the
        buffer of (variant, level, width), sized for the largest request count."""
        width, count = layout.max_width, layout.widths.numel()
        wave = masks.levels[level]
        buf = self._masks.get((variant, level, width))
        if buf is None:  # a variant's trie is fixed, so is the buffer's shape
            most = self.max_rows // width
            buf = torch.ones(most, wave.shape[1], dtype=torch.bool, device=wave.device)
            self._masks[(variant, level, width)] = buf
        buf[: wave.shape[0]].copy_(wave)
        buf[wave.shape[0] : count].fill_(True)  # pad requests: allowed, their beams die anyway
        return FilterMasks.one_level(level, len(masks.levels), buf[:count])

    def _step(
        self, level: int, step: StepInput, score: torch.Tensor, node: torch.Tensor,
        layout: BeamLayout, replay: bool, variant: GraphVariant | None,
        masks: FilterMasks | None = None,
    ) -> Selection:  # fmt: skip
        rows = layout.num_rows
        variant = variant or self.default
        key = (variant.key, level, layout.widths.numel(), layout.max_width, masks is not None)
        if key in self._failed:  # this shape could not be captured: its steps stay eager
            self._eager_reason = self._failed[key]
            self.count_eager(1)
            hidden = self.runner.forward(step)
            return self.selector.select(
                variant.trie, level, hidden, score, node, layout, layout, None, masks
            )
        graph = self._graphs.get(key)
        with torch.inference_mode():
            self._copy_inputs(step)
            self._score[:rows].copy_(score)
            self._node[:rows].copy_(node)
            graph_masks = (
                self._mask_input(variant.key, level, layout, masks) if masks is not None else None
            )
            if graph is None:
                try:
                    graph = self._capture(key, step, layout, variant.trie, graph_masks)
                except (RuntimeError, ValueError) as exc:  # CUDA OOM / capture errors, limits
                    self._failed[key] = (
                        f"capture of level {level}, {key[2]} x {key[3]} failed: {exc}"
                    )
                    return self._step(level, step, score, node, layout, replay, variant, masks)
            else:
                self.runner.attn_backend.plan(step, graph=graph.attention)
            self.stats.replays += replay
            return _owned(_execute(graph, replay))

    def _capture(
        self, key: tuple[int, int, int, int, bool], step: StepInput, layout: BeamLayout,
        trie: Trie, masks: FilterMasks | None,
    ) -> _StepGraph:  # fmt: skip
        _, level, num_requests, _, filtered = key
        rows = layout.num_rows
        start = time.perf_counter()
        attention = self.runner.attn_backend.graph_attention(num_requests, rows)
        metadata = self.runner.attn_backend.plan(step, graph=attention)

        def body() -> Selection:
            hidden = self.runner.forward_batch(
                self._ids[:rows], self._pos[:rows], self._loc[:rows], metadata
            )
            return self.selector.select(
                trie, level, hidden, self._score[:rows], self._node[:rows], layout, layout,
                None, masks,
            )  # fmt: skip

        graph, output = record_graph(body, self._graph_pool())
        captured = _StepGraph(graph, attention, layout, output, body)
        self._graphs[key] = captured
        filtered_note = ", filtered" if filtered else ""
        self._note_capture(
            start,
            f"beam step: level {level}, {num_requests} requests x {layout.max_width} beams"
            f"{filtered_note}",
        )
        return captured
