"""CUDA graphs of the prompt prefill forward, for the small prefills that launches dominate.

Why: run eagerly, one 1,024-token prefill of a 28-layer model issues about 400 kernel launches
from Python; on an H200 the host needed ~28 ms to issue them while the GPU needed ~10 ms to run
them (scripts/profile_request.py, docs/benchmarks.md). An unloaded request, and the small waves
an online server admits at moderate load, wait on the host. A replay issues the whole forward in
one call.

Shapes. A graph is captured per (token bucket T, sequence bucket B): the model's GEMMs have a
fixed row count, FlashInfer's graph-mode prefill a fixed batch size. A prefill of t new tokens
from r requests replays the smallest captured shape with B > r and T >= t + (B - r); its B - r
pad sequences take the T - t spare tokens (one token each, the last one the rest). Pad tokens
write and read only the pad slot (`KVPool.PAD_SLOT`) and their hidden states are never read:
attention never crosses sequences and every other layer works per token. Prefills larger than
the largest bucket (`EngineConfig.prefill_graph_tokens`) or with more than
`SEQUENCE_BUCKETS[-1] - 1` requests run eagerly: their kernels, not their launches, take the time.

The attention plan stays outside the graph (host scheduling into fixed index buffers, as for the
decode graphs), and so does the first beam selection after the prefill. All graphs share one
memory pool: a replay's output is gathered (copied) before the next replay, so graphs may reuse
each other's memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from flashrec_core.attention.step import StepInput
from flashrec_core.engine.graph_capture import record_graph
from flashrec_core.kvcache.pool import KVPool

if TYPE_CHECKING:
    from flashrec_core.config import EngineConfig
    from flashrec_core.engine.model_runner import ModelRunner

logger = logging.getLogger("flashrec")

TOKEN_BUCKETS = (128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
"""Token counts a prefill graph is captured for, up to `EngineConfig.prefill_graph_tokens`.
Steps of 1,024 tokens or more waste at most a third of a bucket on pad tokens."""
SEQUENCE_BUCKETS = (2, 3, 5, 9, 17)
"""Sequence counts: 1, 2, 4, 8 or 16 requests plus at least one pad sequence."""


def token_buckets(max_tokens: int) -> list[int]:
    """The token buckets up to `max_tokens`, which is always one (a setting between buckets)."""
    if max_tokens <= 0:
        return []
    return sorted({t for t in TOKEN_BUCKETS if t < max_tokens} | {max_tokens})


EAGER_CHUNK_TOKENS = 32_768
"""A prefill's most new tokens per forward without prefill graphs: GEMMs of this many rows are
as efficient as larger ones, and the activations stay a few GB."""


def prefill_chunk_tokens(cfg: EngineConfig, graphs: PrefillGraphs | None) -> int:
    """`cfg.prefill_chunk_tokens`, or by default the largest prefill graph's tokens less one
    token for each pad sequence it may need (a chunk of r requests replays the first bucket of
    B > r sequences, B - r of them pads: at most 8, at r = 9), so a full chunk of up to 16
    requests always replays that graph; else EAGER_CHUNK_TOKENS."""
    if cfg.prefill_chunk_tokens is not None:
        return cfg.prefill_chunk_tokens
    if graphs is None:
        return EAGER_CHUNK_TOKENS
    pads = max(
        next(b for b in SEQUENCE_BUCKETS if b > r) - r for r in range(1, SEQUENCE_BUCKETS[-1])
    )
    return graphs.buckets[-1] - pads


def prefill_shape(tokens: int, requests: int, buckets: list[int]) -> tuple[int, int] | None:
    """(T, B) of the graph a prefill of `tokens` new tokens from `requests` requests replays, or
    None (it runs eagerly)."""
    for sequences in SEQUENCE_BUCKETS:
        if sequences > requests:
            need = tokens + sequences - requests
            fits = [t for t in buckets if t >= need]
            return (fits[0], sequences) if fits else None
    return None


MIXED_SEQUENCES = 3
"""The sequence count of every mixed graph's prefill (engine/cuda_graph.py `run_mixed`): one or
two requests and at least one pad sequence. A lightly loaded server admits one or two requests
an iteration, and that is where a prefill's forward carrying the beam steps cuts an iteration
most; larger admissions prefill apart, through the prefill graphs."""
MIXED_MIN_TOKENS = 512
"""A mixed graph's smallest token bucket: below about 512 rows a forward reads the weights for
the same time whatever its rows (docs/benchmarks.md, session 22: an H100's FP8 GEMMs take 1.88
ms at 50 rows, 2.25 at 512), so shorter prefills pad to it and a few shapes serve them all."""


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """The token buckets of mixed graphs' prefills up to `max_tokens`
    (`EngineConfig.mixed_prefill_tokens`)."""
    buckets = token_buckets(max_tokens)
    return [t for t in buckets if t >= MIXED_MIN_TOKENS] or buckets[-1:]


def mixed_prefill_shape(tokens: int, requests: int, max_tokens: int) -> tuple[int, int] | None:
    """(T, B) of the mixed graph a prefill of `tokens` new tokens from `requests` requests
    rides in, or None (it prefills apart)."""
    if requests >= MIXED_SEQUENCES:
        return None
    need = tokens + MIXED_SEQUENCES - requests
    fits = [t for t in mixed_token_buckets(max_tokens) if t >= need]
    return (fits[0], MIXED_SEQUENCES) if fits else None


def fits_prefill_graph(backend: Any, padded: StepInput, tokens: int) -> bool:
    """Whether the attention backend's own prefill path can replay `padded` in a prefill graph
    of `tokens` tokens (`FreshPrefillAttention` has room for as many context rows as tokens);
    backends without the check replay every step that pads to a shape. A prefill graph of a
    step that does not fit is the wrapped backend's (`PrefillGraphs`: a graph per shape and
    path); a mixed step's prefills eagerly."""
    fits = getattr(backend, "fits_prefill_graph", None)
    return fits is None or bool(fits(padded, tokens))


def pad_prefill(step: StepInput, tokens: int, sequences: int) -> StepInput:
    """`step` grown to `tokens` tokens in `sequences` sequences by pad sequences over the pad
    slot (see the module docstring); the real sequences keep their tokens, rows and indices.
    Built in numpy (host work before the prefill's launch, see `prepare_prefill`)."""
    real_tokens, real = step.input_ids.numel(), step.qo_indptr.numel() - 1
    pads, spare = sequences - real, tokens - real_tokens
    if pads < 1 or spare < pads:
        raise ValueError(
            f"{real} sequences of {real_tokens} tokens do not pad to {sequences} x {tokens}"
        )
    lens = np.ones(pads, dtype=np.int64)
    lens[-1] = spare - (pads - 1)
    ends = np.cumsum(lens)
    pad_slots = np.full(spare, KVPool.PAD_SLOT, dtype=np.int64)
    zeros = np.zeros(spare, dtype=np.int64)

    def grown(t: torch.Tensor, tail: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([t.numpy(), tail]))

    qo, kv = step.qo_indptr.numpy(), step.kv_indptr.numpy()
    return StepInput(
        input_ids=grown(step.input_ids, zeros),
        positions=grown(step.positions, zeros),
        out_cache_loc=grown(step.out_cache_loc, pad_slots),
        qo_indptr=grown(step.qo_indptr, qo[-1] + ends),
        kv_indptr=grown(step.kv_indptr, kv[-1] + ends),
        kv_indices=grown(step.flat_kv_indices(), pad_slots),
    )


def empty_prefill() -> StepInput:
    """A prefill of no sequence: `pad_prefill` grows it into pad sequences only, what a warm-up
    captures a shape from."""
    none = torch.zeros(0, dtype=torch.int64)
    start = torch.zeros(1, dtype=torch.int64)
    return StepInput(
        input_ids=none, positions=none, out_cache_loc=none, qo_indptr=start, kv_indptr=start,
        kv_indices=none,
    )  # fmt: skip


GraphKey = tuple[int, int, bool]
"""A prefill graph: (tokens, sequences, wrapped), wrapped for the wrapped backend's path of a
backend that has two (`fits_prefill_graph`)."""


@dataclass
class PrefillGraphStats:
    replays: int = 0
    eager: int = 0  # prefills with no captured shape (too large, too many requests, failed)
    captures: int = 0
    capture_seconds: float = 0.0
    failed: dict[GraphKey, str] = field(default_factory=dict)  # graph -> why


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    attention: Any  # the backend's PrefillGraphAttention for this sequence count
    output: torch.Tensor  # hidden states [T, H], overwritten by each replay
    body: Any  # the captured forward, callable eagerly on the same buffers


class PrefillGraphs:
    """Captured prefill forwards of one engine; see the module docstring."""

    def __init__(self, runner: ModelRunner, max_tokens: int) -> None:
        self.runner = runner
        self.buckets = token_buckets(max_tokens)
        self.stats = PrefillGraphStats()
        self._graphs: dict[GraphKey, _PrefillGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        dev, most = runner.device, self.buckets[-1]
        with torch.inference_mode():
            self._ids = torch.zeros(most, dtype=torch.int64, device=dev)
            self._pos = torch.zeros(most, dtype=torch.int64, device=dev)
            self._loc = torch.zeros(most, dtype=torch.int64, device=dev)

    @classmethod
    def create(cls, runner: ModelRunner) -> PrefillGraphs | None:
        """The engine's prefill graphs, or None (logged) when prefills always run eagerly."""
        cfg = runner.loaded.engine_config
        reason = None
        if not cfg.cuda_graphs or cfg.prefill_graph_tokens == 0:
            reason = "cuda_graphs=False" if not cfg.cuda_graphs else "prefill_graph_tokens=0"
        elif runner.device.type != "cuda":
            reason = f"device is {runner.device.type}"
        elif not getattr(runner.attn_backend, "supports_prefill_graphs", False):
            reason = f"the {runner.attn_backend.name} attention backend cannot capture prefills"
        if reason is not None:
            logger.info("prefill CUDA graphs off (%s): prefills run eagerly", reason)
            return None
        return cls(runner, cfg.prefill_graph_tokens)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (T, B) this engine captures, largest first."""
        return [
            (t, b) for t in reversed(self.buckets) for b in reversed(SEQUENCE_BUCKETS) if t >= b
        ]

    def run(self, step: StepInput, last: torch.Tensor) -> torch.Tensor | None:
        """Hidden states at the token positions `last` (device indices into the step's tokens),
        by replay; None when the step has no graph (the caller runs it eagerly)."""
        return self._forward(step, last, replay=True)

    def run_uncaptured(self, step: StepInput, last: torch.Tensor) -> torch.Tensor | None:
        """The same forward on the same padded buffers and plan, executed eagerly: what a
        replay must equal exactly (tests)."""
        return self._forward(step, last, replay=False)

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> int:
        """Capture every shape not captured yet, largest first (the server's warm-up), over pad
        sequences only; returns how many were captured."""
        keys = [(t, b, False) for t, b in self.shapes()]
        todo = [k for k in keys if k not in self._graphs and k not in self.stats.failed]
        for key in tqdm(todo, desc="prefill graphs", unit="graph", disable=not progress):
            self._graph(key, pad_prefill(empty_prefill(), *key[:2]))
        return len(todo)

    @torch.inference_mode()  # the graph buffers (also the decode graphs') are inference tensors
    def _forward(self, step: StepInput, last: torch.Tensor, replay: bool) -> torch.Tensor | None:
        shape = prefill_shape(step.input_ids.numel(), step.qo_indptr.numel() - 1, self.buckets)
        graph = None
        if shape is not None:
            padded = pad_prefill(step, *shape)
            wrapped = not fits_prefill_graph(self.runner.attn_backend, padded, shape[0])
            key = (*shape, wrapped)
            if key not in self.stats.failed:
                graph = self._graph(key, padded)
        if graph is None:
            self.stats.eager += 1
            return None
        if replay:
            graph.graph.replay()
            self.stats.replays += 1
            return graph.output[last]
        return graph.body()[last]

    def _graph(self, key: GraphKey, padded: StepInput) -> _PrefillGraph | None:
        """The graph of `key` (a shape, and its path) with `padded` loaded into its inputs and
        planned (captured on first use); None if it cannot be captured (the reason is kept and
        logged once)."""
        tokens, sequences, wrapped = key
        with torch.inference_mode():
            self._ids[:tokens].copy_(padded.input_ids, non_blocking=True)
            self._pos[:tokens].copy_(padded.positions, non_blocking=True)
            self._loc[:tokens].copy_(padded.out_cache_loc, non_blocking=True)
        graph = self._graphs.get(key)
        if graph is not None:
            self.runner.attn_backend.plan(padded, graph=graph.attention)
            return graph
        try:
            return self._capture(key, padded)
        except (RuntimeError, ValueError) as exc:  # CUDA OOM / capture errors, buffer limits
            path = " (the wrapped backend's path)" if wrapped else ""
            why = f"capture of the {sequences} x {tokens}-token prefill{path} failed: {exc}"
            self.stats.failed[key] = why
            logger.warning("prefill runs eagerly: %s", why)
            return None

    def _capture(self, key: GraphKey, padded: StepInput) -> _PrefillGraph:
        tokens, sequences, wrapped = key
        start = time.perf_counter()
        # Wrappers per shape, sized by a plan of its own token count (a graph-mode plan fixes
        # the wrapper's grid at its first plan). FlashInfer splits the KV of graph-mode
        # prefills and merges the splits: on an H200 the merge took 41 us a layer for a
        # 1,024-token prompt whether the wrapper was sized for 1,024 or 8,192 tokens, and with
        # split-KV disabled the request took 5 ms longer, so split-KV stays on. The wrappers
        # share the backend's workspace and index buffers: a shape costs no device memory.
        backend = self.runner.attn_backend
        if wrapped:  # the wrapped backend's path of a backend with two
            attention = backend.prefill_graph_attention(sequences, tokens, wrapped=True)
        else:
            attention = backend.prefill_graph_attention(sequences, tokens)
        metadata = backend.plan(padded, graph=attention)

        def body() -> torch.Tensor:
            return self.runner.forward_batch(
                self._ids[:tokens], self._pos[:tokens], self._loc[:tokens], metadata
            )

        graph, output = record_graph(body, self._pool)
        captured = _PrefillGraph(graph, attention, output, body)
        self._graphs[key] = captured
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        logger.debug(
            "captured prefill: %d sequences, %d tokens, in %.2f s", sequences, tokens, seconds
        )
        return captured
