"""Prometheus metrics of one server (prometheus-client, a registry of its own).

Request counts and latency histograms are updated by the HTTP handlers; engine gauges (queue,
running requests and beam rows, KV and request slots, prefix-cache locks) and engine totals
(prefix-cache hit tokens, invalid results) are read from `EngineLoop.stats()` at scrape time, so
they are never stale.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from flashrec_core.engine.handles import LoopStats
from flashrec_core.engine.requests import RequestTimings

# Seconds: beam search requests take milliseconds on a GPU, up to seconds queued under load.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], LoopStats | None], own_process: bool) -> None:
        self._stats, self.own_process = stats, own_process

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        if s is None:  # engine still loading
            return
        gauges = {
            "queue_depth": ("requests waiting for admission", s.queued),
            "running_requests": ("requests in a wave in flight", s.running_requests),
            "running_beam_rows": ("beam rows in flight", s.running_rows),
            "kv_slots_total": ("token slots of the KV pool", s.kv_slots_total),
            "kv_slots_free": ("KV slots neither in use nor cached", s.kv_slots_free),
            "kv_slots_cached": ("KV slots held by the prefix cache", s.kv_slots_cached),
            "kv_slots_used": ("KV slots held by requests in flight", s.kv_slots_used),
            "kv_slots_peak_used": (
                "the most KV slots requests in flight held at once since start (what a pool "
                "needs for this traffic, besides the prefix cache)",
                s.kv_slots_peak_used,
            ),  # fmt: skip
            "prefix_cache_locked_nodes": ("prefix-cache nodes locked", s.prefix_cache_locked_nodes),
            "request_slots_total": ("rows of the request table", s.request_slots_total),
            "request_slots_used": ("request-table rows in use", s.request_slots_used),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"flashrec_{name}", doc, value=value)
        yield CounterMetricFamily(
            "flashrec_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
            value=s.prefix_cache_hit_tokens,
        )  # fmt: skip
        yield CounterMetricFamily(
            "flashrec_invalid_results", "returned beams that are not catalog SIDs (must stay 0)",
            value=s.invalid_results,
        )  # fmt: skip
        retries = CounterMetricFamily(
            "flashrec_engine_admission_retries",
            "waves put back in the queue, by what was short (kv_slots: the pool, device_memory: "
            "the prefill's activations)", labels=["reason"],
        )  # fmt: skip
        retries.add_metric(["kv_slots"], s.admission_retries_kv)
        retries.add_metric(["device_memory"], s.admission_retries_memory)
        yield retries
        totals = {
            "engine_iterations": ("engine loop iterations", s.iterations),
            "engine_waves_admitted": ("waves admitted (one prefill each)", s.waves_admitted),
            "engine_requests_admitted": ("requests admitted into waves", s.requests_admitted),
            "engine_prefill_pieces": (
                "chunked prefill (--prefill-tokens-per-step): prefill pieces run in an iteration "
                "after their wave's admission, the waves in flight stepping in between",
                s.prefill_pieces,
            ),
            "engine_beam_steps": (
                "beam steps of waves (one per wave in flight per iteration)",
                s.beam_steps,
            ),
            "engine_beam_forwards": (
                "model forwards that ran the beam steps (fewer than the steps with "
                "--merge-beam-steps: the waves in flight share one)",
                s.beam_forwards,
            ),
            "engine_mixed_forwards": (
                "of those, an admitted wave's prefill forwards that carried them "
                "(--mixed-prefill-steps)",
                s.mixed_forwards,
            ),
            "engine_busy_seconds": ("engine-thread seconds inside iterations", s.busy_seconds),
            "engine_cpu_seconds": (
                "engine-thread CPU seconds inside iterations (busy less this: waiting for the "
                "GPU, the GIL or a lock)",
                s.cpu_seconds,
            ),
            "engine_side_cpu_seconds": (
                "CPU seconds of the process that runs the engine loop, every thread: this "
                "server's process, or the engine process with --engine-process (then "
                "process_cpu_seconds_total is the HTTP process's alone)",
                s.process_cpu_seconds,
            ),
            "engine_results_wait_seconds": (
                "of the busy seconds, the engine thread blocked on finished waves' beams "
                "reaching the host: how far the GPU's queued work ran ahead of the host",
                s.results_wait_seconds,
            ),
        }
        for name, (doc, value) in totals.items():
            yield CounterMetricFamily(f"flashrec_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "flashrec_engine_own_process", "1 when the engine runs in a process of its own "
            "(--engine-process), else 0", value=int(self.own_process),
        )  # fmt: skip


class _CatalogCollector(Collector):
    def __init__(self, versions: Callable[[], list[Any]], live: Callable[[], list[Any]]) -> None:
        self._versions, self._live = versions, live

    def collect(self) -> Iterator[GaugeMetricFamily]:
        current = GaugeMetricFamily(
            "flashrec_catalog_version", "current version of each named catalog", labels=["name"]
        )
        for v in self._versions():
            current.add_metric([v.name], v.version)
        yield current
        yield GaugeMetricFamily(
            "flashrec_catalog_live_versions",
            "catalog versions still in memory (current ones + ones requests still use)",
            value=len(self._live()),
        )


class _GCPauses(Collector):
    """Pauses of CPython's cyclic garbage collector, by generation, as a histogram.

    A collection holds the GIL, so it stalls the engine thread's launches and the event loop
    alike; a full one walks every tracked object not frozen (engine/heap.py). Recorded through
    `gc.callbacks` into plain lists and read at scrape time: a callback runs inside whatever
    allocation triggered the collection, possibly while that thread holds a metric's lock, so it
    never touches a prometheus-client metric itself."""

    BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

    def __init__(self) -> None:
        self._counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]  # per generation
        self._sums = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._record)

    def _record(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._start
        gen = info["generation"]
        self._counts[gen][bisect.bisect_left(self.BUCKETS, seconds)] += 1
        self._sums[gen] += seconds

    def close(self) -> None:
        """Stop recording (a process that outlives its server, such as a test session)."""
        if self._record in gc.callbacks:
            gc.callbacks.remove(self._record)

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "flashrec_gc_young_threshold",
            "net allocations between young collections (--gc-young-threshold once ready)",
            value=gc.get_threshold()[0],
        )  # fmt: skip
        family = HistogramMetricFamily(
            "flashrec_gc_pause_seconds",
            "pauses of the cyclic garbage collector (GIL held), by generation (2: full)",
            labels=["generation"],
        )
        bounds = [*map(str, self.BUCKETS), "+Inf"]
        for gen in range(3):
            counts = itertools.accumulate(self._counts[gen])
            family.add_metric([str(gen)], list(zip(bounds, counts)), self._sums[gen])
        yield family


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], LoopStats | None],
        catalogs: tuple[Callable[[], list[Any]], Callable[[], list[Any]]] | None = None,
        engine_own_process: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[Any, ...], Any] = {}
        self.requests = Counter(
            "flashrec_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "flashrec_request_latency_seconds", "end-to-end latency of answered requests",
            ["endpoint"], buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.stage = Histogram(
            "flashrec_request_stage_seconds",
            "time per request stage: intake (the HTTP side, arrival to the engine), queue, "
            "prefill (with first selection), decode (beam steps), shaping (the HTTP side, "
            "result to response body)",
            ["stage"], buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.event_loop_lag = Histogram(
            "flashrec_event_loop_lag_seconds",
            "how late the HTTP event loop wakes from a 100 ms sleep (GIL or blocking callbacks)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=self.registry,
        )  # fmt: skip
        self.filtered = Counter(
            "flashrec_filtered_requests", "requests with item filters (exclude, allow, filters)",
            registry=self.registry,
        )  # fmt: skip
        self.filtered_sids = Counter(
            "flashrec_filtered_sids",
            "catalog SIDs closed to requests by their item filters, summed over requests",
            registry=self.registry,
        )  # fmt: skip
        self.deduplicated = Counter(
            "flashrec_deduplicated_items", "repeated items dropped from return='items' lists",
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(stats, engine_own_process))
        # process_cpu_seconds_total, resident memory, open files (from /proc, on Linux): less
        # flashrec_engine_cpu_seconds_total, the CPU the HTTP side spends
        ProcessCollector(registry=self.registry)
        if catalogs is not None:
            self.registry.register(_CatalogCollector(*catalogs))
        self.gc_pauses = _GCPauses()
        self.registry.register(self.gc_pauses)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self._child(self.requests, endpoint, str(status)).inc()
        if status == 200:
            self._child(self.latency, endpoint).observe(seconds)

    def observe_stages(self, timings: RequestTimings | None) -> None:
        if timings is None:
            return
        self.observe_stage("queue", timings.queue_s)
        self.observe_stage("prefill", timings.prefill_s)
        self.observe_stage("decode", timings.decode_s)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """One stage of an answered request: the engine's (`observe_stages`), or the HTTP
        side's "intake" (its arrival to its submission: body, validation, chat template,
        tokenizing) or "shaping" (its engine result reaching the route to the response body
        built: choices, items, JSON)."""
        self._child(self.stage, stage).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: `labels()` takes a lock and checks its
        arguments on every call, five times a request on the event loop thread. A child is
        made on first use, as before, so /metrics lists the same series."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
