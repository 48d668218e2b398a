"""What clients of the engine loop hold and catch: request handles, the loop's budgets and
stats snapshot, and the errors a submission can end in."""

from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from flashrec_core.engine.requests import GenerationRequest, GenerationResult


class RequestRejectedError(ValueError):
    """A request this engine can never serve (too wide, too long); `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class DeviceMemoryError(RuntimeError):
    """The device ran out of memory for a request's activations (the KV pool itself is checked
    by `EngineLoop.check`). `retry`: it ran out beside other requests and may fit later; else it
    failed alone, so it cannot fit on this engine as configured (`param` names the field)."""

    def __init__(self, message: str, param: str | None, retry: bool) -> None:
        super().__init__(message)
        self.param, self.retry = param, retry


class QueueFullError(RuntimeError):
    """The bounded queue is full; retry later."""


class EngineStoppedError(RuntimeError):
    """The loop is shutting down (or stopped) and admits no new requests."""


class RequestCancelledError(RuntimeError):
    """The request was cancelled (client gone, shutdown) before it finished."""


class RequestTimeoutError(TimeoutError):
    """The request's deadline passed before it finished."""


@dataclass(frozen=True)
class Limits:
    """Budgets the loop admits under (from the engine's config and pool)."""

    max_wave_rows: int
    max_context: int
    max_position: int
    depth: int
    max_queue: int


def check_request(request: GenerationRequest, lim: Limits, kv_slots: int) -> None:
    """Raise RequestRejectedError if an engine with these budgets and `kv_slots` KV slots can
    never serve `request`."""
    prompt = len(request.prompt_ids)
    if request.n > lim.max_wave_rows:
        raise RequestRejectedError(
            f"n={request.n} exceeds the beam-row budget of {lim.max_wave_rows} rows per "
            "step (--max-wave-rows)", "n",
        )  # fmt: skip
    if prompt + lim.depth > lim.max_position or prompt > lim.max_context:
        limit = min(lim.max_position - lim.depth, lim.max_context)
        raise RequestRejectedError(
            f"the prompt has {prompt} tokens; this engine takes at most {limit} "
            "(--max-context and the model's max_position_embeddings, less the SID depth)",
            "messages",
        )  # fmt: skip
    need = prompt + request.n * (lim.depth - 1)
    if need > kv_slots:
        raise RequestRejectedError(
            f"the request needs {need} KV slots (prompt + n x {lim.depth - 1} beam steps) "
            f"but the pool holds {kv_slots} (--kv-cache-tokens)", "n",
        )  # fmt: skip


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its future, and `cancel()` (effective at the next step boundary)."""

    request: GenerationRequest
    request_id: str
    deadline: float | None  # time.monotonic() value, or None
    future: Future[GenerationResult] = field(default_factory=Future)
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    prefilled_at: float | None = None
    _cancel_reason: str | None = None

    def cancel(self, reason: str = "cancelled by the client") -> None:
        self._cancel_reason = reason

    @property
    def cancelled(self) -> bool:
        return self._cancel_reason is not None

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def succeed(self, result: GenerationResult) -> None:
        """Set the result, unless the future is settled already: a client may cancel its side
        (asyncio's wrap_future cancels this future) at any moment, and nobody reads it then."""
        try:
            self.future.set_result(result)
        except InvalidStateError:
            pass

    def fail(self, exc: BaseException) -> None:
        """Set the error, unless the future is settled already (see `succeed`)."""
        try:
            self.future.set_exception(exc)
        except InvalidStateError:
            pass


@dataclass(frozen=True)
class LoopStats:
    """A snapshot for /metrics and tests (gauges, then totals since start)."""

    queued: int
    running_requests: int
    running_rows: int
    kv_slots_total: int
    kv_slots_free: int
    kv_slots_cached: int
    prefix_cache_locked_nodes: int
    request_slots_total: int
    request_slots_used: int
    prefix_cache_hit_tokens: int
    invalid_results: int
    iterations: int
    waves_admitted: int = 0
    requests_admitted: int = 0
    prefill_pieces: int = 0  # chunked prefill: pieces run in an iteration after the admission
    beam_steps: int = 0  # a wave's beam step, one per wave in flight per iteration
    beam_forwards: int = 0  # model forwards that ran them (fewer with merge_beam_steps)
    mixed_forwards: int = 0  # of those, prefill forwards that carried them (mixed_prefill_steps)
    busy_seconds: float = 0.0  # inside run_once: the engine thread's working time
    cpu_seconds: float = 0.0  # CPU time of the threads running run_once, inside it
    process_cpu_seconds: float = 0.0  # CPU time of the whole process running the loop
    results_wait_seconds: float = 0.0  # of busy_seconds, blocked on finished beams' copies
    kv_slots_used: int = 0  # held by requests in flight (neither free nor cached)
    kv_slots_peak_used: int = 0  # the most kv_slots_used since start (after an admission)
    admission_retries_kv: int = 0  # waves put back in the queue: too few KV slots free
    admission_retries_memory: int = 0  # waves put back: their prefill ran out of device memory
