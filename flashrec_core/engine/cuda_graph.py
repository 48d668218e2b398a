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
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from flashrec_core.engine.beam_inputs import concat_beam_steps, pad_requests_step
from flashrec_core.search.beam import BeamLayout, Selection
from flashrec_core.search.filters import FilterMasks
from flashrec_core.search.selector import BeamSelector
from flashrec_core.search.trie import Trie

if TYPE_CHECKING:
    from flashrec_core.attention.flashinfer import GraphAttention
    from flashrec_core.engine.model_runner import ModelRunner, StepInput

logger = logging.getLogger("flashrec")
T = TypeVar("T")

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


def record_graph(body: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `body` into a graph of memory pool `pool`, after one run outside it on a side
    stream (Triton compiles, cuBLAS picks its algorithms; it writes the same K/V the replay
    writes, so it is harmless). Returns the graph and the captured output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = body()
    return graph, output


@dataclass
class GraphStats:
    replays: int = 0
    eager_steps: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    eager_reasons: Counter[str] = field(default_factory=Counter)
    forward_replays: int = 0  # merged steps' forwards replayed
    eager_forwards: int = 0  # merged steps' forwards run eagerly (no shape, capture failed)


@dataclass
class _ForwardGraph:
    """A merged beam step's model forward (no selection) at one padded shape."""

    graph: torch.cuda.CUDAGraph
    attention: GraphAttention
    hidden: torch.Tensor  # the captured output [padded rows, hidden]


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
        self, runner: ModelRunner, selector: BeamSelector, trie: Trie, max_rows: int
    ) -> None:
        self.runner = runner
        self.selector = selector
        self.default = GraphVariant(0, trie)  # steps that name no variant
        self.max_rows = max_rows
        self.stats = GraphStats()
        # (variant, level, requests, width, filtered)
        self._graphs: dict[tuple[int, int, int, int, bool], _StepGraph] = {}
        self._failed: dict[tuple[int, int, int, int, bool], str] = {}  # why capture failed
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (variant, level, width)
        self._forwards: dict[tuple[int, int], _ForwardGraph] = {}  # (requests, width)
        self._forward_failed: dict[tuple[int, int], str] = {}
        self._pad_steps: dict[tuple[int, int], StepInput] = {}  # (pad requests, width)
        self._pool = torch.cuda.graph_pool_handle()
        dev = runner.device
        with torch.inference_mode():
            self._ids = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._pos = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._loc = torch.zeros(max_rows, dtype=torch.int64, device=dev)
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
        return cls(runner, selector, trie, cfg.max_wave_rows)

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

    def forward(self, step: StepInput, width: int, suffix_width: int) -> torch.Tensor | None:
        """Hidden states of a merged beam step (`BeamWave.advance_together`: requests of
        `width` rows, each row at most `suffix_width` own slots) by replay of the forward graph
        of its padded request count, captured on first use; None (counted, logged once) when
        no shape fits or its capture failed: the caller runs the forward eagerly. The result
        is a view of the graph's output, valid until the next replay."""
        sp = step.shared_prefix
        assert sp is not None, "a beam step"
        num_requests, rows = sp.prefix_qo_indptr.numel() - 1, step.input_ids.numel()
        padded, why = graph_padding([width] * num_requests, False, self.max_rows)
        if rows != num_requests * width:
            padded, why = None, "a merged step of waves of different n"
        key = (padded or 0, width)
        if padded is not None and key in self._forward_failed:
            padded, why = None, self._forward_failed[key]
        if padded is None:
            self.stats.eager_forwards += 1
            self._log_once(f"merged beam steps run their forward eagerly: {why}")
            return None
        if padded > num_requests:
            step = concat_beam_steps([step, self._pad_step(padded - num_requests, width)])
        graph = self._forwards.get(key)
        with torch.inference_mode():
            self._copy_inputs(step)
            if graph is None:
                try:
                    graph = self._capture_forward(key, step, suffix_width)
                except (RuntimeError, ValueError) as exc:  # CUDA OOM / capture errors, limits
                    self._forward_failed[key] = f"capture of {key[0]} x {key[1]} failed: {exc}"
                    return self.forward(step, width, suffix_width)
            else:
                self.runner.attn_backend.plan(step, graph=graph.attention)
            graph.graph.replay()
        self.stats.forward_replays += 1
        return graph.hidden[:rows]

    def _pad_step(self, num_pad: int, width: int) -> StepInput:
        """The step of `num_pad` pad requests of `width` rows, built once per shape: it is the
        same every time (its tensors are only read), and building it is a dozen small device
        allocations and fills on the engine thread per merged step."""
        key = (num_pad, width)
        step = self._pad_steps.get(key)
        if step is None:
            step = self._pad_steps[key] = pad_requests_step(num_pad, width, self.runner.device)
        return step

    def capture_forwards(self, width: int, counts: list[int], suffix_width: int) -> None:
        """Capture the merged-step forward graphs of `width` at `counts` requests (largest
        first, as `warm_counts` orders them) from steps of pad requests only, so traffic replays
        them (the server's warm-up)."""
        for count in counts:
            if (count, width) not in self._forwards:
                step = pad_requests_step(count, width, self.runner.device)
                self.forward(step, width, suffix_width)

    def _copy_inputs(self, step: StepInput) -> None:
        rows = step.input_ids.numel()
        self._ids[:rows].copy_(step.input_ids, non_blocking=True)
        self._pos[:rows].copy_(step.positions, non_blocking=True)
        self._loc[:rows].copy_(step.out_cache_loc, non_blocking=True)

    def _capture_forward(
        self, key: tuple[int, int], step: StepInput, suffix_width: int
    ) -> _ForwardGraph:
        num_requests, width = key
        rows = num_requests * width
        start = time.perf_counter()
        attention = self.runner.attn_backend.graph_attention(
            num_requests, rows, suffix_width=suffix_width
        )
        metadata = self.runner.attn_backend.plan(step, graph=attention)

        def body() -> torch.Tensor:
            return self.runner.forward_batch(
                self._ids[:rows], self._pos[:rows], self._loc[:rows], metadata
            )

        graph, hidden = record_graph(body, self._pool)
        captured = _ForwardGraph(graph, attention, hidden)
        self._forwards[key] = captured
        self._note_capture(start, f"merged beam-step forward: {num_requests} requests x {width}")
        return captured

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
        for table in (self._graphs, self._failed, self._masks):
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
            if replay:
                graph.graph.replay()
                self.stats.replays += 1
                out = graph.output
            else:
                out = graph.body()
            return Selection(out.parent.clone(), out.code.clone(), out.node.clone(),
                             out.score.clone())  # fmt: skip

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

        graph, output = record_graph(body, self._pool)
        captured = _StepGraph(graph, attention, layout, output, body)
        self._graphs[key] = captured
        filtered_note = ", filtered" if filtered else ""
        self._note_capture(
            start,
            f"beam step: level {level}, {num_requests} requests x {layout.max_width} beams"
            f"{filtered_note}",
        )
        return captured
