"""The engine in a process of its own (`flashrec serve --engine-process`).

In one process the engine thread shares the GIL with the HTTP side, and every millisecond of
Python the event loop runs (parsing, validation, tokenizing, shaping, metrics, the collector) is
one the engine thread may wait before it launches the next step: the server reached 90-92% of
`Engine.generate` on some hosts and 83-85% on slower ones (docs/architecture.md). vLLM's V1
engine core answers this with a process apart from the API server; so does this module.

The HTTP process holds a `RemoteEngine`: a front (tokenizer, SID layout, catalogs on the host;
`engine/front.py`) whose `loop` is an `EngineClient`, the pipe's end that offers the calls the
server makes of an `EngineLoop` (submit, check, wake, stats, stop, profiler windows) plus
catalog commands. The engine process (`run_engine_process`) builds the `Engine` as the
in-process server does and runs its loop unchanged; a receiver thread there submits and cancels
between the loop's steps, command threads answer stats, catalog and profiler commands, and the
engine thread sends each finished request's result itself (a sender thread measured one more
wake-up per request: 0.4-0.6 ms of unloaded latency on the CPU machine).

What crosses the pipe (pickled tuples over a `multiprocessing` pipe):
- a request: token ids, n, temperature, seed, the (name, version) of the catalog it was bound to,
  and its item filter's SID bits (the engine process rebuilds a search-only filter over its own
  copy of that catalog version; the item mask stays with the HTTP side, which shapes answers),
  timeout and request id;
- a result: its arrays (codes, log-probs, catalog rows, per-level log-probs), cached tokens,
  notes and timings; the HTTP process attaches its own decoder and filter to shape the answer;
- errors as (kind, message, param, retry), raised again as the engine's own exception types;
- commands with replies: stats for /metrics, catalog load and delete, the profiler, stop.

Both processes load every catalog (the engine for its trie on the device, the HTTP side for
filters and item ids), so a catalog's host memory is held twice. Version numbers are the HTTP
side's: it loads and checks a catalog first, then has the engine load it under the same number.
The engine process keeps each version the HTTP side still references until that side drops it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import uuid
import weakref
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashrec_core.engine.catalogs import CatalogVersion
from flashrec_core.engine.front import EngineFront
from flashrec_core.engine.handles import (
    DeviceMemoryError,
    EngineStoppedError,
    Limits,
    LoopStats,
    QueueFullError,
    RequestCancelledError,
    RequestRejectedError,
    RequestTimeoutError,
    check_request,
)
from flashrec_core.engine.requests import GenerationRequest, GenerationResult, RequestTimings
from flashrec_core.engine.trace import TraceStateError
from flashrec_core.search.filters import ItemFilter
from flashrec_core.server.settings import ServerSettings

logger = logging.getLogger("flashrec.server")

_LOAD_TIMEOUT_S = 3600.0
"""How long the HTTP process waits for the engine process to load the checkpoint."""
_LOGGERS = ("", "flashrec", "flashrec.server")
"""Loggers whose levels the engine process takes from the HTTP process's (the CLI sets them)."""
_COMMAND_TIMEOUT_S = 600.0
"""A command's reply (a catalog load with its graph warm-up is the longest)."""
_STATS_TIMEOUT_S = 5.0
"""/metrics waits this long for the engine's stats, then leaves its engine gauges out."""


# -- the wire ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireRequest:
    key: int
    prompt_ids: tuple[int, ...]
    n: int
    temperature: float
    seed: int | None
    catalog: tuple[str, int]
    sid_bits: np.ndarray | None  # ItemFilter.packed_sids: the search needs no item mask
    timeout: float | None
    request_id: str


@dataclass(frozen=True)
class WireResult:
    codes: np.ndarray
    logprobs: np.ndarray
    nodes: np.ndarray
    level_logprobs: np.ndarray | None
    prompt_tokens: int
    cached_tokens: int
    notes: list[str]
    timings: RequestTimings | None


_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        QueueFullError, EngineStoppedError, RequestCancelledError, RequestTimeoutError,
        RequestRejectedError, DeviceMemoryError, TraceStateError,
    )
}  # fmt: skip


def encode_error(exc: BaseException) -> tuple[str, str, str | None, bool]:
    """An exception as (kind, message, param, retry): the engine's own errors keep their type
    and fields across the pipe; anything else becomes a RuntimeError with its text."""
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "RuntimeError"
    message = str(exc) if kind != "RuntimeError" else f"{type(exc).__name__}: {exc}"
    return kind, message, getattr(exc, "param", None), bool(getattr(exc, "retry", False))


def decode_error(wire: tuple[str, str, str | None, bool]) -> BaseException:
    kind, message, param, retry = wire
    if kind == "RequestRejectedError":
        return RequestRejectedError(message, param or "n")
    if kind == "DeviceMemoryError":
        return DeviceMemoryError(message, param, retry)
    return _ERRORS.get(kind, RuntimeError)(message)


def _wire_request(key: int, req: GenerationRequest, timeout: float | None, rid: str) -> Any:
    assert req.catalog is not None, "the server binds a catalog version to every request"
    f = req.item_filter
    return WireRequest(
        key, req.prompt_ids, req.n, req.temperature, req.seed,
        (req.catalog.name, req.catalog.version),
        f.packed_sids if f is not None else None, timeout, rid,
    )  # fmt: skip


def _wire_result(result: GenerationResult) -> WireResult:
    return WireResult(
        result.codes, result.logprobs, result.nodes, result.level_logprobs,
        result.prompt_tokens, result.cached_tokens, result.notes, result.timings,
    )  # fmt: skip


# -- the HTTP process's end ----------------------------------------------------------------


class RemoteHandle:
    """A request submitted to the engine process: its future and `cancel()`."""

    def __init__(self, request: GenerationRequest, key: int, client: EngineClient) -> None:
        self.request, self.key, self._client = request, key, client
        self.future: Future[GenerationResult] = Future()

    def cancel(self, reason: str = "cancelled by the client") -> None:
        try:
            self._client._send(("cancel", self.key, reason))
        except EngineStoppedError:  # the engine process is gone, and the request with it
            pass

    def settle(self, value: GenerationResult | BaseException) -> None:
        """Set the result or error unless the future is settled already (the client may have
        cancelled its side: asyncio's wrap_future cancels this future)."""
        if self.future.done():
            return
        try:
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)
        except Exception:  # settled between the check and the set (InvalidStateError)
            pass


class _TraceState:
    def __init__(self, client: EngineClient) -> None:
        self._client = client

    @property
    def active(self) -> bool:
        return bool(self._client.command("trace_active"))


class EngineClient:
    """The pipe to the engine process, with the calls the server makes of an `EngineLoop`."""

    def __init__(self, settings: ServerSettings) -> None:
        self._settings = settings
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = ctx.Pipe()
        levels = {name: logging.getLogger(name).level for name in _LOGGERS}
        self._process = ctx.Process(
            target=run_engine_process,
            args=(settings, child, levels),
            name="flashrec-engine",
            daemon=True,  # ended with this process, whatever way it exits
        )
        self._child_end = child
        self._send_lock = threading.Lock()
        self._keys = itertools.count(1)
        self._pending: dict[int, RemoteHandle] = {}
        self._replies: dict[int, Future[Any]] = {}
        self._released: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._hello: Future[dict[str, Any]] = Future()
        self.warmed: Future[str] = Future()
        """Resolves with the engine's device-memory line when its warm-up is done."""
        self.limits: Limits | None = None
        self.kv_slots = 0
        self.facts: dict[str, Any] = {}
        self.trace = _TraceState(self)
        self._reader: threading.Thread | None = None

    # -- start and stop --

    def launch(self) -> None:
        """Start the engine process; it loads the checkpoint and catalogs while this process
        loads its front (`RemoteEngine.start`)."""
        self._process.start()
        self._child_end.close()
        self._reader = threading.Thread(target=self._read, name="flashrec-engine-pipe", daemon=True)
        self._reader.start()

    def start(self, profile_to: Path | None = None) -> None:
        """Where the server would start an `EngineLoop`: the engine process runs its loop from
        its load on, so a loop not running here means the engine process has exited."""
        del profile_to  # the engine process reads settings.profile_engine itself
        raise EngineStoppedError("the engine process has exited; the server must be restarted")

    def wait_loaded(self, front: EngineFront) -> None:
        """Wait until the engine process has loaded (a load error there is raised here, as a
        RuntimeError with its message) and check it serves the catalog versions `front` holds."""
        try:
            hello = self._hello.result(timeout=_LOAD_TIMEOUT_S)
        except futures.TimeoutError:
            self.abort()
            raise RuntimeError(
                f"the engine process did not load the checkpoint in {_LOAD_TIMEOUT_S:.0f} s"
            ) from None
        self.limits, self.kv_slots, self.facts = hello["limits"], hello["kv_slots"], hello["facts"]
        mine = sorted((v.name, v.version) for v in front.catalogs.current())
        if sorted(hello["catalogs"]) != mine:
            self.stop(0)
            raise RuntimeError(
                f"the engine process loaded catalogs {hello['catalogs']}, this one {mine}"
            )
        for version in front.catalogs.current():
            self.track(version)
        logger.info("engine process %d: loaded", self._process.pid)

    @property
    def running(self) -> bool:
        return self._process.is_alive()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop admitting, let requests in flight finish within `grace_s` (the engine process
        drains as `EngineLoop.stop` does), then wait for the process to exit."""
        if self._process.is_alive():
            try:
                self.command("stop", grace_s, timeout=grace_s + 120)
                self._send(("bye",))
            except (EngineStoppedError, futures.TimeoutError, TimeoutError) as exc:
                logger.warning("engine process did not stop cleanly: %s", exc)
        self._process.join(timeout=30)
        if self._process.is_alive():
            logger.warning("engine process %d did not exit; killing it", self._process.pid)
            self.abort()
        self._conn.close()

    def abort(self) -> None:
        """End the engine process now, loaded or not (SIGKILL: it ignores SIGTERM, which is the
        HTTP process's to handle)."""
        self._process.kill()
        self._process.join(timeout=10)

    # -- requests --

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestRejectedError if the engine can never serve `request`."""
        assert self.limits is not None, "the engine process has not started"
        check_request(request, self.limits, self.kv_slots)

    def submit(
        self,
        request: GenerationRequest,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> RemoteHandle:
        """Send a request to the engine. A refusal there (queue full, shutting down) arrives as
        the future's exception, not raised here."""
        self.check(request)
        handle = RemoteHandle(request, next(self._keys), self)
        self._pending[handle.key] = handle
        try:
            self._send(("submit", _wire_request(handle.key, request, timeout,
                                                request_id or uuid.uuid4().hex)))  # fmt: skip
        except EngineStoppedError:
            self._pending.pop(handle.key, None)
            raise
        return handle

    def wake(self) -> None:
        """Nothing to do: a cancel wakes the engine's loop where it arrives."""

    def stats(self) -> LoopStats | None:
        try:
            return self.command("stats", timeout=_STATS_TIMEOUT_S)
        except (EngineStoppedError, futures.TimeoutError, TimeoutError):
            return None

    def start_trace(self) -> None:
        self.command("start_trace")

    def stop_trace(self, directory: Path) -> tuple[Path, Path]:
        return self.command("stop_trace", directory)

    # -- catalogs --

    def track(self, version: CatalogVersion) -> None:
        """Tell the engine process to drop its copy of `version` once this process drops it
        (sent with the next message: a finalizer must not take the pipe's lock)."""
        weakref.finalize(version, self._released.put, (version.name, version.version))

    def add_catalog(self, version: CatalogVersion) -> dict[str, Any]:
        """Have the engine load `version` (checked here already) under its number, warm its
        graphs and serve it; returns its description there."""
        described = self.command("add_catalog", version.name, version.source, version.version)
        self.track(version)
        return described

    # -- the pipe --

    def command(self, name: str, *args: Any, timeout: float = _COMMAND_TIMEOUT_S) -> Any:
        future: Future[Any] = Future()
        cid = next(self._keys)
        self._replies[cid] = future
        try:
            self._send(("command", cid, name, args))
            return future.result(timeout=timeout)
        except futures.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            message = f"the engine process did not answer {name!r} in {timeout:.0f} s"
            raise TimeoutError(message) from None
        finally:
            self._replies.pop(cid, None)

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                while True:
                    try:
                        released = self._released.get_nowait()
                    except queue.Empty:
                        break
                    self._conn.send(("release", released))
                self._conn.send(message)
            except (OSError, ValueError):  # closed: the engine process is gone
                raise EngineStoppedError("the engine process has exited") from None

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "result":
                handle = self._pending.pop(message[1], None)
                if handle is not None:
                    handle.settle(self._result(handle.request, message[2]))
            elif kind == "failed":
                handle = self._pending.pop(message[1], None)
                if handle is not None:
                    handle.settle(decode_error(message[2]))
            elif kind == "reply":
                future = self._replies.get(message[1])
                if future is not None and not future.done():
                    ok, value = message[2], message[3]
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(decode_error(value))
            elif kind == "hello":
                self._hello.set_result(message[1])
            elif kind == "load_failed":
                self._hello.set_exception(RuntimeError(message[1]))
            elif kind == "ready":
                self.limits = message[2]  # warm-up may lower the row budget
                self.warmed.set_result(message[1])
            elif kind == "warmup_failed":
                self.warmed.set_exception(RuntimeError(message[1]))
        self._gone()

    def _gone(self) -> None:
        """The pipe closed: fail everything still waiting on the engine process."""
        self._process.join(timeout=5)  # closed its end: exiting, if not exited yet
        code = self._process.exitcode
        why = EngineStoppedError(f"the engine process has exited (exit code {code})")
        for handle in list(self._pending.values()):
            handle.settle(why)
        self._pending.clear()
        for future in list(self._replies.values()) + [self._hello, self.warmed]:
            if not future.done():
                future.set_exception(why)

    @staticmethod
    def _result(request: GenerationRequest, wire: WireResult) -> GenerationResult:
        version = request.catalog
        assert version is not None
        return GenerationResult(
            wire.codes, wire.logprobs, wire.nodes, wire.prompt_tokens, request.n,
            version.decoder, level_logprobs=wire.level_logprobs,
            cached_tokens=wire.cached_tokens, notes=wire.notes, timings=wire.timings,
            item_filter=request.item_filter, catalog=(version.name, version.version),
        )  # fmt: skip


class RemoteEngine(EngineFront):
    """The HTTP process's engine when the engine runs apart: a front whose `loop` is the pipe."""

    loop: EngineClient

    @classmethod
    def start(cls, settings: ServerSettings) -> RemoteEngine:
        """Start the engine process, load the front here meanwhile (tokenizer, catalogs; no
        weights, no device: the two loads overlap), then wait for the engine's load."""
        client = EngineClient(settings)
        client.launch()
        try:
            self = cls.from_config(settings.engine, settings.search)
            assert isinstance(self, RemoteEngine)
            for name, path in settings.catalogs.items():  # the engine process adds them alike
                self.add_catalog(name, path)
            self.loop = client
            client.wait_loaded(self)
        except BaseException:
            # an error here or there, or Ctrl-C: end the engine process, loaded or not. Left
            # to multiprocessing's exit clean-up it would get SIGTERM, which it ignores, and
            # this process would wait for it forever.
            client.abort()
            raise
        return self


# -- the engine process --------------------------------------------------------------------


def run_engine_process(settings: ServerSettings, conn: Any, levels: dict[str, int]) -> None:
    """The engine process's main: build the engine, then serve the pipe until told to stop or
    until the HTTP process goes away."""
    # The HTTP process decides when this one stops: Ctrl-C in a terminal reaches the whole
    # process group, and a SIGTERM from a supervisor is the HTTP process's to drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # daemon=True is for the HTTP process (it ends this one at exit); here it would only forbid
    # children, which a kernel library's compile workers may need
    multiprocessing.current_process().daemon = False
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    from flashrec_core.server.loading import load_engine, model_facts

    try:
        engine = load_engine(settings)
        facts = model_facts(engine)
    except Exception as exc:  # the HTTP process reports it and exits 2, as in one process
        logger.exception("engine process: load failed")
        conn.send(("load_failed", " ".join(str(exc).split())))
        return
    _EngineWorker(engine, settings, conn).serve(facts)


class _EngineWorker:
    def __init__(self, engine: Any, settings: ServerSettings, conn: Any) -> None:
        self.engine, self.settings, self.conn = engine, settings, conn
        self._send_lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._versions: dict[tuple[str, int], CatalogVersion] = {
            (v.name, v.version): v for v in engine.catalogs.current()
        }
        self._commands = ThreadPoolExecutor(4, thread_name_prefix="flashrec-command")
        self._stopped = False

    def serve(self, facts: dict[str, Any]) -> None:
        from flashrec_core.server.main import SWITCH_INTERVAL_S

        sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in one process: the receiver is Python
        loop = self.engine.loop
        loop.start(profile_to=self.settings.profile_engine)
        self._post(("hello", {
            "limits": loop.limits, "kv_slots": self.engine.runner.allocator.num_slots - 1,
            "facts": facts, "catalogs": sorted(self._versions),
        }))  # fmt: skip
        threading.Thread(target=self._warm_up, name="flashrec-warmup", daemon=True).start()
        self._receive()
        if not self._stopped:  # it went away without a stop: drain briefly
            loop.stop(grace_s=5.0)
        self._commands.shutdown(wait=True)

    def _post(self, message: tuple[Any, ...]) -> None:
        """Send to the HTTP process from any thread (the engine thread sends results itself:
        a sender thread would add a wake-up to every request's latency)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the HTTP process is gone; the receiver sees it too
                pass

    def _warm_up(self) -> None:
        from flashrec_core.engine.heap import freeze_long_lived, set_young_threshold
        from flashrec_core.server.loading import device_memory
        from flashrec_core.server.warmup import warm_up

        try:
            warm_up(self.engine, self.settings.warmup_n)
        except Exception as exc:
            logger.exception("warm-up failed")
            self._post(("warmup_failed", f"warm-up failed: {exc}"))
            return
        freeze_long_lived()
        set_young_threshold(self.settings.gc_young_threshold)
        self._post(("ready", device_memory(self.engine), self.engine.loop.limits))

    def _receive(self) -> None:
        """Serve the pipe until the HTTP process says goodbye (after `stop`) or goes away."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "submit":
                self._submit(message[1])
            elif kind == "cancel":
                handle = self._handles.get(message[1])
                if handle is not None:
                    handle.cancel(message[2])
                    self.engine.loop.wake()
            elif kind == "release":
                self._versions.pop(message[1], None)
            elif kind == "bye":
                return
            elif kind == "command":
                # on the command thread, so cancels still arrive while a stop drains
                self._commands.submit(self._run_command, message[1], message[2], message[3])

    def _submit(self, wire: WireRequest) -> None:
        version = self._versions.get(wire.catalog)
        if version is None:  # released: cannot happen while the HTTP side holds the request
            error = EngineStoppedError(f"catalog version {wire.catalog} is no longer served")
            self._post(("failed", wire.key, encode_error(error)))
            return
        item_filter = None
        if wire.sid_bits is not None and version.index is not None:
            item_filter = ItemFilter.for_search(wire.sid_bits, version.index)
        try:
            request = GenerationRequest(
                wire.prompt_ids, wire.n, wire.temperature, wire.seed, item_filter, version
            )
            handle = self.engine.loop.submit(
                request, timeout=wire.timeout, request_id=wire.request_id
            )
        except Exception as exc:  # queue full, stopping, rejected: the client's future fails
            self._post(("failed", wire.key, encode_error(exc)))
            return
        self._handles[wire.key] = handle
        handle.future.add_done_callback(lambda f, key=wire.key: self._done(key, f))

    def _done(self, key: int, future: Future[GenerationResult]) -> None:
        """On the engine thread: send the result (a few KB of arrays; the HTTP process's reader
        thread drains the pipe, so the write does not wait)."""
        self._handles.pop(key, None)
        exc = future.exception()
        if exc is not None:
            self._post(("failed", key, encode_error(exc)))
        else:
            self._post(("result", key, _wire_result(future.result())))

    def _reply(self, cid: int, run: Any) -> None:
        try:
            self._post(("reply", cid, True, run()))
        except Exception as exc:
            self._post(("reply", cid, False, encode_error(exc)))

    def _run_command(self, cid: int, name: str, args: tuple[Any, ...]) -> None:
        loop = self.engine.loop
        commands = {
            "stats": loop.stats,
            "trace_active": lambda: loop.trace.active,
            "start_trace": loop.start_trace,
            "stop_trace": lambda: loop.stop_trace(*args),
            "add_catalog": lambda: self._add_catalog(*args),
            "remove_catalog": lambda: self.engine.catalogs.remove(*args).describe(),
            "catalogs": self._catalogs,
            "stop": lambda: self._stop(*args),
        }
        self._reply(cid, commands[name])

    def _stop(self, grace_s: float) -> None:
        self._stopped = True
        self.engine.loop.stop(grace_s)

    def _add_catalog(self, name: str, path: str, number: int) -> dict[str, Any]:
        from flashrec_core.engine.heap import freeze_long_lived
        from flashrec_core.server.warmup import warm_catalog

        version = self.engine.load_catalog_version(name, path, number)
        warm_catalog(self.engine, version, self.settings.warmup_n)
        self._versions[(name, number)] = version
        self.engine.catalogs.put(version)
        freeze_long_lived(collect=False)
        return version.describe()

    def _catalogs(self) -> dict[str, Any]:
        catalogs = self.engine.catalogs
        return {
            "data": [v.describe() for v in catalogs.current()],
            "live_versions": [v.describe() for v in catalogs.live()],
        }
