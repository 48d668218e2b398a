"""The engine loop: one thread owns the device; any thread or asyncio task submits a request and
gets a handle with a future.

Work runs in iterations, each a step boundary:
1. retire: requests cancelled or past their deadline leave their wave (rows, KV slots, table
   rows and prefix-cache locks are handed back) or the queue;
2. step: every wave in flight runs one beam step (with `merge_beam_steps`, all of them through
   one model forward: `BeamWave.step_groups`); a wave whose last step ran hands its KV back
   at once and starts the copy of its beams to the host;
3. admit: queued requests form a new wave (KV allocated, prefill, first selection) under the
   beam-row, request-table and KV-slot budgets, which include the KV just handed back;
4. results: the finished waves' beams become results while the GPU runs the prefill queued in
   3 (the copies were queued before it, so the host waits only for them).

Under load every iteration runs one new wave's prefill and the beam steps of the waves admitted
in the iterations before (a wave lives `depth` iterations). A request that arrives while others
run therefore waits about one iteration, not for a whole wave. A wave takes the queue's oldest
request and then other queued requests of the same n and catalog version (one width per wave lets
its steps replay CUDA graphs); a request of another n is never passed over for more than one
iteration per distinct n queued before it.

With `schedule = "decode_first"` step 3 admits only when no wave is in flight: each wave's steps
run back to back after its prefill, with no other wave's prefill between them.

With `schedule = "admit_first"` each iteration admits (3) before it steps (2), and the new wave
takes its first beam step in the same iteration, in the forward the waves in flight share: a
wave lives `depth - 1` iterations, not `depth`, for the same GPU work. Its finished waves' copies
are queued behind that iteration's prefill, so their results come at the next iteration's end
when the GPU still runs them (see `_deliver`). The KV that this iteration's last steps hand
back serves the next admission, not this one. Measured on an H100 it did not shorten the
latency tail: the iterations grew by more than the one saved (docs/benchmarks.md, session 30).

With `prefill_tokens_per_step` set, step 3 runs only about that many new prompt tokens of the
admitted wave's prefill (whole prefill forwards, at least one) while other waves are in flight,
and the rest in the next iterations' step 3, one piece each, before any other wave is admitted:
the waves in flight step between its pieces, so a beam step waits for one piece of prefill,
not a whole wave's (chunked prefill). The wave joins the stepping waves after its last piece.
Its requests leave it (cancel, timeout) only then.

With `mixed_prefill_steps`, the admission of step 3 carries one step group of step 2: the new
wave's prefill and that group's beam steps run as one model forward (`BeamWave.begin_mixed`:
`ModelRunner.forward_segments` eagerly, one replay of a mixed graph with CUDA graphs), so the
weights are read once for both. When no wave is admitted, or its prefill takes several forwards
or has no mixed graph, the group steps on its own.

`run_once` is the whole iteration. The background thread (`start`) calls it while there is work;
without a thread, `Engine.generate` calls it itself until its requests are done: offline and
online use the same code path.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import logging
import pstats
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from flashrec_core.config import Schedule
from flashrec_core.engine.beam_wave import BeamWave, WaveState
from flashrec_core.engine.handles import (
    DeviceMemoryError,
    EngineStoppedError,
    Limits,
    LoopStats,
    QueueFullError,
    RequestCancelledError,
    RequestHandle,
    RequestTimeoutError,
    check_request,
)
from flashrec_core.engine.requests import (
    GenerationRequest,
    GenerationResult,
    RequestTimings,
    ResultDecoder,
)
from flashrec_core.engine.results import HostBeams, assemble_results, copy_to_host
from flashrec_core.engine.trace import LoopTrace
from flashrec_core.kvcache import OutOfSlotsError

logger = logging.getLogger("flashrec")
T = TypeVar("T")


@dataclass
class _Wave:
    state: WaveState
    handles: list[RequestHandle]


@dataclass
class _Finished:
    """A wave whose last step ran: its KV is handed back, its beams are on their way to the
    host, and what the results need is kept here (`release` clears the state)."""

    handles: list[RequestHandle]
    beams: HostBeams
    requests: list[GenerationRequest]
    cached_lens: list[int]
    decoder: ResultDecoder
    behind_admission: bool = False  # its last step is queued behind a prefill (`_deliver`)
    deferred: bool = False  # its copy was still running at an iteration's end (`_deliver`)


class EngineLoop:
    """Admits, steps and retires requests; see the module docstring."""

    def __init__(self, wave: BeamWave, decoder: ResultDecoder, limits: Limits) -> None:
        self.wave = wave
        self.decoder = decoder
        self.limits = limits
        self._queue: deque[RequestHandle] = deque()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()  # see `call`
        self._waves: list[_Wave] = []
        self._prefilling: _Wave | None = None  # a wave whose prefill runs in pieces
        self._finished: list[_Finished] = []  # within one iteration: step -> results
        self._cv = threading.Condition()
        self._drive = threading.Lock()  # one driver of run_once at a time
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._exit = False
        self._admit_cap: int | None = None  # after a KV shortfall: at most this many per wave
        self.trace = LoopTrace()  # torch.profiler windows (start_trace / stop_trace)
        self.intra_op_threads: int | None = None
        """torch intra-op (CPU) threads of the thread running the loop: the loop thread
        (`start`), or a caller driving it (`wait_done`) for that long (EngineConfig.host_threads);
        None: torch's default."""
        self.schedule: Schedule = "interleaved"
        """"interleaved": admit at every step boundary; "decode_first": only once no wave is in
        flight; "admit_first": admit, then step (EngineConfig.schedule; module docstring)."""
        self.admission_delay_factor = 0.0
        """While waves are in flight, admit only once this many times the last prefill's
        duration has passed since the last admission (the server's setting; 0: every step).
        Interleaved only: a decode-first loop admits with nothing in flight."""
        self.mixed_prefill_steps = True
        """An admitted wave's prefill carries one step group's beam steps in its forward
        (EngineConfig.mixed_prefill_steps, module docstring)."""
        self.prefill_tokens_per_step: int | None = None
        """New prompt tokens of a wave's prefill per iteration while waves are in flight (None:
        its whole prefill at once; EngineConfig.prefill_tokens_per_step, module docstring)."""
        self._prefill_queued = False
        """This iteration has queued a prefill: beam steps queued from now on, and the copies
        of the waves they finish, run after it on the GPU (`_finish`, `_deliver`)."""
        self._last_admit_at = 0.0
        self._last_prefill_s = 0.0
        self._admit_started = 0.0  # when the wave prefilling now was admitted
        self._prefill_spent_s = 0.0  # the iterations of its pieces so far
        self._hit_tokens = 0
        self._retries_kv = 0  # admissions put back: KV slots short
        self._retries_memory = 0  # admissions put back: device memory short
        self._invalid = 0
        self._iterations = 0
        self._waves_admitted = 0
        self._prefill_pieces = 0
        self._beam_steps = 0
        self._beam_forwards = 0
        self._mixed_forwards = 0
        self._requests_admitted = 0
        self._busy_s = 0.0
        self._cpu_s = 0.0
        self._results_wait_s = 0.0  # blocked on finished beams' copies (`_deliver`)
        self._peak_kv_used = 0

    # -- clients --------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestRejectedError if this engine can never serve `request`."""
        check_request(request, self.limits, self.wave.runner.allocator.num_slots - 1)

    def submit(
        self,
        request: GenerationRequest,
        timeout: float | None = None,
        request_id: str | None = None,
        *,
        bounded: bool = True,
    ) -> RequestHandle:
        """Queue a request. Raises RequestRejectedError, QueueFullError (only when `bounded`:
        offline batches are not bounded by the online queue) or EngineStoppedError."""
        self.check(request)
        deadline = time.monotonic() + timeout if timeout is not None else None
        handle = RequestHandle(request, request_id or uuid.uuid4().hex, deadline)
        with self._cv:
            if not self._accepting:
                raise EngineStoppedError("the engine is shutting down and admits no new requests")
            if bounded and len(self._queue) >= self.limits.max_queue:
                raise QueueFullError(
                    f"the queue is full ({self.limits.max_queue} requests waiting); retry later"
                )
            self._queue.append(handle)
            self._cv.notify_all()
        return handle

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread at the next step boundary and return its result (its
        exception is raised here): device work outside requests, such as capturing graphs, must
        not race the thread that owns the device. Without a running thread it runs here."""
        if not self.running:
            with self._drive:
                return fn()
        future: Future = Future()
        with self._cv:
            self._tasks.append((fn, future))
            self._cv.notify_all()
        return future.result()

    def start_trace(self) -> None:
        """Open a torch.profiler window on the thread that runs the loop (engine/trace.py)."""
        self.call(self.trace.start)

    def stop_trace(self, directory: Path) -> tuple[Path, Path]:
        """Close the window at the next step boundary and write its trace and summary files
        (on this thread: the engine thread goes on meanwhile)."""
        prof, started_at = self.call(self.trace.close)
        return self.trace.write(prof, started_at, directory)

    def _run_tasks(self) -> None:
        while self._tasks:
            fn, future = self._tasks.popleft()
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def wake(self) -> None:
        """Wake the loop thread (after a cancel) so it retires the request promptly."""
        with self._cv:
            self._cv.notify_all()

    def stats(self) -> LoopStats:
        runner = self.wave.runner
        cache = runner.prefix_cache
        waves = list(self._waves) + ([self._prefilling] if self._prefilling else [])
        return LoopStats(
            queued=len(self._queue),
            running_requests=sum(len(w.handles) for w in waves),
            running_rows=sum(h.request.n for w in waves for h in w.handles),
            kv_slots_total=runner.allocator.num_slots - 1,
            kv_slots_free=runner.allocator.num_free,
            kv_slots_cached=cache.num_cached if cache is not None else 0,
            prefix_cache_locked_nodes=cache.num_locked_nodes() if cache is not None else 0,
            request_slots_total=len(runner.request_table.lengths),
            request_slots_used=runner.request_table.num_active,
            prefix_cache_hit_tokens=self._hit_tokens,
            invalid_results=self._invalid,
            iterations=self._iterations,
            waves_admitted=self._waves_admitted,
            requests_admitted=self._requests_admitted,
            prefill_pieces=self._prefill_pieces,
            beam_steps=self._beam_steps,
            beam_forwards=self._beam_forwards,
            mixed_forwards=self._mixed_forwards,
            busy_seconds=self._busy_s,
            cpu_seconds=self._cpu_s,
            process_cpu_seconds=time.process_time(),
            results_wait_seconds=self._results_wait_s,
            kv_slots_used=self._kv_used(),
            kv_slots_peak_used=self._peak_kv_used,
            admission_retries_kv=self._retries_kv,
            admission_retries_memory=self._retries_memory,
        )

    @property
    def idle(self) -> bool:
        return (
            not self._queue and not self._waves and self._prefilling is None
            and not self._finished and not self._tasks
        )  # fmt: skip

    # -- the thread -----------------------------------------------------------------------

    def start(self, profile_to: Path | None = None) -> None:
        """Run the loop on a background thread (the server's engine thread). With
        `profile_to`, cProfile runs on that thread and its stats are written there on exit."""
        assert self._thread is None, "the loop runs once"
        target = self._run if profile_to is None else lambda: _profiled(self._run, profile_to)
        self._thread = threading.Thread(target=target, name="flashrec-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop admitting, let queued and running requests finish within `grace_s`, cancel
        what is left (EngineStoppedError), and end the thread."""
        with self._cv:
            self._accepting = False
            self._cv.notify_all()
        end = time.monotonic() + grace_s
        while not self.idle and time.monotonic() < end and self.running:
            time.sleep(0.01)
        waves = self._waves + ([self._prefilling] if self._prefilling else [])
        for h in list(self._queue) + [h for w in waves for h in w.handles]:
            h.cancel("the engine stopped before the request finished")
        with self._cv:
            self._exit = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        _name_os_thread("flashrec-engine")
        if self.intra_op_threads is not None:  # a per-thread OpenMP setting: set it here
            torch.set_num_threads(self.intra_op_threads)
        while True:
            with self._cv:
                while self.idle and not self._exit:
                    self._cv.wait()
                if self._exit and self.idle:
                    return
            try:
                self.run_once()  # after stop(), this iteration retires the cancelled requests
            except Exception as exc:  # a bug: fail what is in flight, keep the thread serving
                logger.exception("engine loop iteration failed")
                self._fail_everything(exc)

    def _fail_everything(self, exc: Exception) -> None:
        for wave in list(self._waves):
            self._fail_wave(wave, exc)
        if self._prefilling is not None:
            wave, self._prefilling = self._prefilling, None
            self.wave.release(wave.state, False)
            for h in wave.handles:
                h.fail(exc)

    # -- one iteration --------------------------------------------------------------------

    def run_once(self) -> None:
        """Retire, step, admit, results (module docstring)."""
        with self._drive:
            self._run_tasks()
            now, cpu = time.monotonic(), time.thread_time()
            phase = self.trace.phase
            with phase("iteration"):
                with phase("retire"):
                    self._retire(now)
                self._prefill_queued = False
                if self.schedule == "admit_first":
                    with phase("admit"):
                        self._admit(now, [])
                    with phase("step"):
                        for group in self._step_groups():
                            self._advance(group)
                else:
                    groups = self._step_groups()
                    beside = groups.pop(0) if groups and self._mixing() else []
                    with phase("step"):
                        for group in groups:
                            self._advance(group)
                    with phase("admit"):
                        self._admit(now, beside)
                self._peak_kv_used = max(self._peak_kv_used, self._kv_used())  # iteration's most
                with phase("results"):
                    self._deliver()
            self._iterations += 1
            self._busy_s += time.monotonic() - now
            self._cpu_s += time.thread_time() - cpu  # busy less this: waits (GPU, GIL, locks)

    def _step_groups(self) -> list[list[_Wave]]:
        """The waves in flight, grouped as their beam steps share forwards (`step_groups`)."""
        waves = list(self._waves)
        return [
            [waves[i] for i in group] for group in self.wave.step_groups([w.state for w in waves])
        ]

    def _kv_used(self) -> int:
        """KV slots held by requests in flight (neither free nor in the prefix cache)."""
        runner = self.wave.runner
        cached = runner.prefix_cache.num_cached if runner.prefix_cache is not None else 0
        return runner.allocator.num_slots - 1 - runner.allocator.num_free - cached

    def _retire(self, now: float) -> None:
        with self._cv:
            keep: deque[RequestHandle] = deque()
            for h in self._queue:
                if not self._fail_if_done(h, now):
                    keep.append(h)
            self._queue = keep
        for wave in list(self._waves):
            mask = [not self._fail_if_done(h, now) for h in wave.handles]
            if all(mask):
                continue
            self.wave.drop(wave.state, mask)
            wave.handles = [h for h, k in zip(wave.handles, mask) if k]
            if not wave.handles:
                self._waves.remove(wave)
                self.wave.release(wave.state, False)  # nothing left but its catalog reference

    @staticmethod
    def _fail_if_done(h: RequestHandle, now: float) -> bool:
        """Fail a cancelled or expired request's future; whether it must leave."""
        if h.future.done():  # failed elsewhere already
            return True
        if h._cancel_reason is not None:
            h.fail(RequestCancelledError(h._cancel_reason))
            return True
        if h.expired(now):
            h.fail(RequestTimeoutError("the request's timeout passed"))
            return True
        return False

    def _mixing(self) -> bool:
        """Whether this iteration's admission may carry a step group (`mixed_prefill_steps`):
        requests are queued, the wave runner can mix (`BeamWave.mixes_prefills`), and the
        admission does not depend on which waves are still in flight after the steps
        (decode-first, an admission delay) nor runs in pieces (chunked prefill)."""
        return (
            self.mixed_prefill_steps and bool(self._queue) and self._prefilling is None
            and self.schedule == "interleaved" and self.admission_delay_factor == 0
            and self.prefill_tokens_per_step is None and self.wave.mixes_prefills
        )  # fmt: skip

    def _admit(self, now: float, beside: list[_Wave]) -> None:
        """Admit a wave; the waves `beside` (a step group, or none) take their beam step in its
        prefill's forward, or on their own (before that prefill) when no wave is admitted or
        the prefill cannot carry them."""
        if not self._admit_wave(now, beside) and beside:
            self._advance(beside)

    def _admit_wave(self, now: float, beside: list[_Wave]) -> bool:
        """Whether the waves `beside` stepped."""
        if self._prefilling is not None:  # its next piece; no other wave until it is done
            self._prefill(self._prefilling, now)
            return False
        if self._waves and self.schedule == "decode_first":
            return False  # the waves in flight run their remaining steps back to back first
        wait = self.admission_delay_factor * self._last_prefill_s
        if self._waves and now - self._last_admit_at < wait:
            return False  # let the queue grow into a larger wave; the waves in flight step
        handles = self._take_wave()
        if not handles:
            return False
        admitted = time.monotonic()  # not `now` (the iteration's start): a request may have
        for h in handles:  # been submitted since, and its queue time would come out negative
            h.admitted_at = admitted
        budget = self.prefill_tokens_per_step if self._waves else None
        self._admit_started, self._prefill_spent_s = now, 0.0
        requests, mixed, apart = [h.request for h in handles], False, False
        try:
            if beside:
                state, mixed = self.wave.begin_mixed(requests, [w.state for w in beside])
                if not mixed:
                    # Nothing ran: their step first, as in the step phase, so that their
                    # finished beams' copies are not queued behind the prefill.
                    try:
                        self._advance(beside)  # fails only their waves on an error
                    except BaseException:  # interrupted: the new wave's KV goes back too
                        self.wave.release(state, False)
                        raise
                    apart = True
                    self.wave.prefill_or_release(state)
            else:
                state = self.wave.begin(requests, budget)
        except BaseException as exc:  # the new wave's KV is handed back (BeamWave.begin_mixed)
            self._prefill_failed(handles, exc)
            return apart
        self._prefill_queued = True
        if mixed:
            self._mixed_forwards += 1
            self._stepped(beside)
        self._prefilled(_Wave(state, handles), now)
        return mixed or apart

    def _prefill(self, wave: _Wave, now: float) -> None:
        """The next piece of a wave's prefill (chunked prefill, module docstring); alone, with
        no wave in flight to step between pieces, all the rest at once."""
        budget = self.prefill_tokens_per_step if self._waves else None
        self._prefill_pieces += 1
        try:
            self.wave.prefill_some(wave.state, budget)
        except BaseException as exc:
            self._prefilling = None
            self.wave.release(wave.state, False)
            self._prefill_failed(wave.handles, exc)
            return
        self._prefill_queued = True
        self._prefilled(wave, now)

    def _prefilled(self, wave: _Wave, now: float) -> None:
        """After `begin` or a piece: a wave whose prefill is done joins the stepping waves."""
        self._prefill_spent_s += time.monotonic() - now
        state = wave.state
        if state.prefill is not None:
            self._prefilling = wave
            return
        self._prefilling = None
        self._admit_cap = None
        self._waves_admitted += 1
        self._requests_admitted += len(wave.handles)
        self._hit_tokens += sum(state.cached_lens)
        self._last_admit_at, self._last_prefill_s = self._admit_started, self._prefill_spent_s
        done = time.monotonic()
        for h in wave.handles:
            h.prefilled_at = done
        self._waves.append(wave)
        if state.level >= self.wave.depth:  # depth-1 SIDs finish at their prefill
            self._finish(wave)

    def _prefill_failed(self, handles: list[RequestHandle], exc: BaseException) -> None:
        """A prefill that raised (its KV is handed back already): retry smaller or later, or
        fail its requests."""
        if isinstance(exc, OutOfSlotsError):
            self._retries_kv += 1
            self._requeue(handles, exc)
        elif isinstance(exc, torch.OutOfMemoryError):  # activations: a smaller wave may fit
            _release_cached_blocks()
            self._retries_memory += 1
            logger.warning(
                "the prefill of %d requests ran out of device memory beside %d waves in flight; "
                "retrying with at most %d (lower --mem-fraction or --prefill-chunk-tokens to "
                "leave activations more room)", len(handles), len(self._waves),
                max(1, len(handles) // 2),
            )  # fmt: skip
            self._requeue(handles, _too_big_alone(handles[0].request), halve=True)
        elif isinstance(exc, Exception):  # a bug or device error: fail these, keep serving
            logger.exception("prefill of %d requests failed", len(handles), exc_info=exc)
            for h in handles:
                h.fail(exc)
        else:
            raise exc

    def _take_wave(self) -> list[RequestHandle]:
        """The oldest queued request and further queued requests of its n and catalog version,
        within budgets."""
        runner = self.wave.runner
        table_free = len(runner.request_table.lengths) - runner.request_table.num_active
        cap = min(table_free, self._admit_cap or table_free)
        with self._cv:
            if not self._queue or cap == 0:
                return []
            head = self._queue[0].request
            n, catalog = head.n, head.catalog  # one width and one catalog version per wave
            taken, rest, rows = [], deque(), 0
            for h in self._queue:
                same = h.request.n == n and h.request.catalog is catalog
                fits = same and rows + n <= self.limits.max_wave_rows
                if fits and len(taken) < cap:
                    taken.append(h)
                    rows += n
                else:
                    rest.append(h)
            self._queue = rest
            return taken

    def _requeue(
        self,
        handles: list[RequestHandle],
        exc: OutOfSlotsError | DeviceMemoryError,
        halve: bool = False,
    ) -> None:
        """The pool (or the device's free memory) cannot hold this wave now. KV comes back as
        the waves in flight finish: with some in flight, wait for them; alone, or after a
        shortfall of device memory (`halve`: the waves in flight hold theirs until they end,
        and a retry of the same size would fail again), retry with half as many requests. A
        single request alone cannot ever fit: it fails with `exc`."""
        if not self._waves and len(handles) == 1:
            handles[0].fail(exc)
            return
        if halve or not self._waves:
            self._admit_cap = max(1, len(handles) // 2)
        with self._cv:
            self._queue.extendleft(reversed(handles))

    def _advance(self, waves: list[_Wave]) -> None:
        """One beam step of `waves` (one forward when several: `BeamWave.step_groups`); a
        failure fails every wave of the step."""
        try:
            self.wave.advance_together([w.state for w in waves])
        except torch.OutOfMemoryError:
            _release_cached_blocks()
            requests = sum(len(w.handles) for w in waves)
            rows = sum(h.request.n for w in waves for h in w.handles)
            error = DeviceMemoryError(
                f"the device ran out of memory in a beam step of {requests} requests "
                f"({rows} beam rows) beside {len(self._waves) - len(waves)} other waves; retry, "
                "or lower --max-wave-rows or --mem-fraction to leave room for activations",
                None, retry=True,
            )  # fmt: skip
            for wave in waves:
                self._fail_wave(wave, error)
            return
        except Exception as exc:
            logger.exception(
                "a beam step of %d requests failed", sum(len(w.handles) for w in waves)
            )
            for wave in waves:
                self._fail_wave(wave, exc)
            return
        self._stepped(waves)

    def _stepped(self, waves: list[_Wave]) -> None:
        """After one forward stepped `waves`: counters, and the waves whose last step it was
        finish (behind this iteration's prefill once one is queued: `_prefill_queued`)."""
        self._beam_steps += len(waves)
        self._beam_forwards += 1
        for wave in waves:
            if wave.state.level >= self.wave.depth:
                self._finish(wave, self._prefill_queued)

    def _fail_wave(self, wave: _Wave, exc: Exception) -> None:
        """Take a wave out of flight, hand its KV back, fail its requests with `exc` (those
        not failed already)."""
        self._waves.remove(wave)
        self.wave.release(wave.state, False)
        for h in wave.handles:
            h.fail(exc)

    def _finish(self, wave: _Wave, behind_admission: bool = False) -> None:
        """The wave's last step ran: start its beams' copy to the host, hand its KV back now
        (later GPU work that reuses the slots is queued behind the step), and leave the results
        to `_deliver` at the end of the iteration (`behind_admission`: the step is queued after
        this iteration's prefill, or ran in its forward, and so is the copy)."""
        state = wave.state
        try:
            decoder = state.version.decoder if state.version is not None else self.decoder
            beams = copy_to_host(self.wave.output(state))
        except Exception as exc:  # a bug or device error: these requests fail, keep serving
            logger.exception("results of %d requests could not be fetched", len(wave.handles))
            self._fail_wave(wave, exc)
            return
        finished = _Finished(
            wave.handles, beams, list(state.requests), list(state.cached_lens), decoder,
            behind_admission,
        )  # fmt: skip
        self._waves.remove(wave)
        self.wave.release(state, True)
        self._finished.append(finished)

    def _deliver(self) -> None:
        """Results of the waves finished this iteration (module docstring, step 4). The copies
        of waves that finished in the step phase are queued before the admission's prefill,
        so waiting for them leaves that prefill queued on the GPU. A wave whose last step ran
        in the admission's mixed forward (`BeamWave.begin_mixed`), or after the admission
        (admit_first), has its copy queued after all of it: while other work is in flight and
        the copy is still running, it waits for the next iteration's end instead, whose GPU
        work is queued by then (waiting here would leave the GPU idle while the host prepares
        the next iteration; measured on an H100, session 29, iterations grew from 10 to 35 ms
        at 0.7x of saturation). A copy that nothing follows because no wave was admitted is
        waited for: deferring it too, so that the next step is queued first, lengthened the
        tail at 0.7x (p99 115-120 against 110 ms, session 31), for the loop is bound by the
        GPU there, and a deferred wave's results waited for the host's next iteration."""
        finished, self._finished = self._finished, []
        busy = bool(self._waves or self._queue)
        for f in finished:
            if busy and f.behind_admission and not f.deferred and not f.beams.ready():
                f.deferred = True
                self._finished.append(f)
                continue
            waited = time.monotonic()
            f.beams.wait()  # the GPU is this far ahead of the host (a CUDA wait spins: CPU too)
            self._results_wait_s += time.monotonic() - waited
            try:
                out = assemble_results(f.beams, f.requests, f.cached_lens, f.decoder)
            except Exception as exc:  # a bug: these requests fail, the loop keeps serving
                logger.exception("results of %d requests could not be assembled", len(f.handles))
                for h in f.handles:
                    h.fail(exc)
                continue
            self._invalid += out.invalid
            if out.invalid:
                logger.error("%d returned beams are not catalog SIDs (a search bug)", out.invalid)
            end = time.monotonic()
            for h, result in zip(f.handles, out.results):
                timings = RequestTimings(
                    queue_s=(h.admitted_at or end) - h.submitted_at,
                    prefill_s=(h.prefilled_at or end) - (h.admitted_at or end),
                    decode_s=end - (h.prefilled_at or end),
                )
                h.succeed(replace(result, timings=timings))


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS as well (Linux, 15 bytes at most), so `top -H`,
    /proc/PID/task/*/comm and py-spy tell the engine thread from the HTTP side's threads. The
    OpenMP workers it starts later inherit the name."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # no prctl here (not Linux): the name is cosmetic
        pass


def _too_big_alone(request: GenerationRequest) -> DeviceMemoryError:
    """The error of a request whose prefill ran out of device memory with nothing else in
    flight (the loop raises it only then; beside other waves it waits and retries)."""
    return DeviceMemoryError(
        f"the request (a {len(request.prompt_ids)}-token prompt, n={request.n}) ran out of "
        "device memory for its activations with nothing else running; lower n or the prompt, "
        "or give activations more room (a lower --mem-fraction or --kv-cache-tokens)",
        "n", retry=False,
    )  # fmt: skip


def _release_cached_blocks() -> None:
    """After an out-of-memory error: hand the allocator's cached blocks back, so the retry (or
    the next wave) starts from unfragmented free memory."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profiled(run: Callable[[], None], path: Path) -> None:
    """Run `run` under cProfile; write the top functions by cumulative and by own time."""
    profile = cProfile.Profile()
    try:
        profile.runcall(run)
    finally:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        path.write_text(text.getvalue())
        logger.info("engine thread profile written to %s", path)


def wait_done(loop: EngineLoop, handles: Sequence[RequestHandle]) -> None:
    """Return once every handle is done: the loop thread runs them, or without one, this
    thread drives the loop itself."""
    if loop.running:
        for h in handles:
            h.future.exception()  # waits; a failure is the caller's to read
        return
    with _intra_op_threads(loop.intra_op_threads):
        while not all(h.future.done() for h in handles):
            loop.run_once()


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` on this thread for the block (None: as they
    are), then put back."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wait_all(loop: EngineLoop, handles: Sequence[RequestHandle]) -> list[GenerationResult]:
    """Results of `handles` in order (the first failure is raised)."""
    wait_done(loop, handles)
    return [h.future.result() for h in handles]
