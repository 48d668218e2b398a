"""The OpenAI-compatible HTTP API over one engine (FastAPI; uvicorn runs it in the engine's
process, the engine loop on its own thread).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (behind the API key when
one is set), GET /health (alive), GET /ready (warm-up done), GET /metrics (Prometheus).
A handler validates and tokenizes, submits to the engine loop, and awaits the request's future
or the client going away (then the request is cancelled and its rows, KV slots
and prefix-cache locks are freed at the next step boundary).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

from fastapi import Depends, FastAPI, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flashrec_core.engine.catalogs import CatalogNotFoundError, CatalogVersion
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.handles import (
    DeviceMemoryError,
    EngineStoppedError,
    QueueFullError,
    RequestCancelledError,
    RequestRejectedError,
    RequestTimeoutError,
)
from flashrec_core.engine.heap import freeze_long_lived, set_young_threshold
from flashrec_core.engine.requests import GenerationRequest, GenerationResult
from flashrec_core.engine.trace import TraceStateError
from flashrec_core.server import responses
from flashrec_core.server.encoding import JSON, JSONRoute, dumps
from flashrec_core.server.engine_process import RemoteEngine
from flashrec_core.server.errors import APIError, install_error_handlers
from flashrec_core.server.loading import device_memory, model_facts
from flashrec_core.server.metrics import ServerMetrics
from flashrec_core.server.middleware import RequestLogMiddleware
from flashrec_core.server.protocol import (
    CatalogInfo,
    CatalogList,
    CatalogUpload,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelList,
    ProfileStatus,
)
from flashrec_core.server.settings import ServerSettings
from flashrec_core.server.translate import Defaults, chat_request, completion_requests
from flashrec_core.server.warmup import warm_catalog, warm_up

logger = logging.getLogger("flashrec.server")

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "a bad field (named in error.param), n or prompt over a limit",
        401: "missing or wrong API key",
        404: "unknown model",
        503: "queue full, warming up or shutting down (Retry-After)",
        504: "the request's timeout passed",
    }.items()
}
_SSE_EVENT = {  # one server-sent event: `data:` holds a JSON chunk, or [DONE] at the end
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
STREAMED: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {
        "description": "the ranked choices; with `stream: true` an SSE stream: one chunk with every "
        "choice, one usage chunk, then `data: [DONE]`",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    },
}


INLINE_TRANSLATE_BYTES = 64 * 1024
"""Bodies up to this size without item filters are checked and tokenized on the event loop
thread. Tokenizing holds the GIL either way, so a worker thread adds no parallelism, only its
hand-off (anyio's queue, limiter and wake-up: 0.2 of the 0.84 ms of HTTP-thread CPU an n=50
request took, measured on the CPU machine). Larger bodies (long text) and filtered requests
(masks over the whole catalog: 1-3 ms at a million items) go to a worker thread, which the
interpreter switches away from every few hundred microseconds, so one of them cannot keep the
event loop from other requests' I/O for its whole duration."""


def _translate_inline(request: Request, body: Any) -> bool:
    """Whether this request is translated on the event loop (INLINE_TRANSLATE_BYTES). A chunked
    body (no Content-Length) counts as large: its size is not known up front."""
    if body.exclude_items or body.allow_items is not None or body.filters:
        return False
    length = request.headers.get("content-length", "")
    return length.isdigit() and int(length) <= INLINE_TRANSLATE_BYTES


Served = Engine | RemoteEngine
"""The engine a server runs: in this process, or a front with a pipe to the engine process."""


@dataclass
class ServerState:
    engine: Served
    settings: ServerSettings
    metrics: ServerMetrics
    facts: dict[str, Any]  # loading.model_facts, for /v1/models
    ready: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    warmup_error: str | None = None


def create_app(engine: Served, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(
        engine.loop.stats, (engine.catalogs.current, engine.catalogs.live),
        engine_own_process=isinstance(engine, RemoteEngine),
    )  # fmt: skip
    facts = engine.loop.facts if isinstance(engine, RemoteEngine) else model_facts(engine)
    state = ServerState(engine, settings, metrics, facts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.loop.running:
            engine.loop.start(profile_to=settings.profile_engine)
        threading.Thread(
            target=_warm_up, args=(state,), name="flashrec-warmup", daemon=True
        ).start()
        lag = asyncio.create_task(_watch_event_loop_lag(state.metrics))
        yield
        lag.cancel()
        state.stopping = True
        if settings.torch_profile_dir is not None and engine.loop.trace.active:
            files = await run_in_threadpool(engine.loop.stop_trace, settings.torch_profile_dir)
            logger.info("shutdown: the open torch profile was written to %s", files[0])
        logger.info("draining: up to %.0f s for requests in flight", settings.shutdown_grace_s)
        await run_in_threadpool(engine.loop.stop, settings.shutdown_grace_s)
        state.metrics.gc_pauses.close()

    app = FastAPI(
        title="FlashRec", version=_version(), lifespan=lifespan,
        description="OpenAI-compatible generative recommendation (SID beam search); docs/api.md",
    )  # fmt: skip
    app.state.flashrec = state
    app.router.route_class = JSONRoute  # request bodies through encoding.loads
    install_error_handlers(app)
    app.add_middleware(RequestLogMiddleware, metrics=state.metrics, enabled=settings.log_requests)
    _add_routes(app, state)
    return app


def _warm_up(state: ServerState) -> None:
    engine = state.engine
    try:
        if isinstance(engine, RemoteEngine):  # the engine process warms itself up
            memory = engine.loop.warmed.result()
        else:
            warm_up(engine, state.settings.warmup_n)
            memory = device_memory(engine)
    except Exception as exc:  # keep serving /health; /ready says why it is not ready
        logger.exception("warm-up failed")
        state.warmup_error = exc.args[0] if isinstance(engine, RemoteEngine) else (
            f"warm-up failed: {exc}")  # fmt: skip
        return
    freeze_long_lived()  # the model, tokenizer and catalogs stay: keep the collector off them
    set_young_threshold(state.settings.gc_young_threshold)
    state.ready.set()
    logger.info("ready: serving %s%s", state.settings.model_name, memory)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine, settings = state.engine, state.settings
    defaults = Defaults(n=settings.default_n, timeout_s=settings.request_timeout_s)
    key = settings.api_key.get_secret_value().encode() if settings.api_key else None

    async def authorize(request: Request) -> None:
        # async: FastAPI runs a plain `def` dependency on a worker thread, and that hand-off was
        # a tenth of the HTTP thread's time per request (py-spy, docs/serving.md)
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise APIError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                "invalid_api_key", {"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    # without a key no route takes the dependency: FastAPI's solving it was 6 us a request
    guard = [Depends(authorize)] if key is not None else []

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(
                404, f"model {name!r} is not served here; GET /v1/models lists "
                f"{settings.model_name!r}", "model", "model_not_found",
            )  # fmt: skip

    def check_serving() -> None:
        if _engine_gone(engine):
            raise APIError(503, "the engine process has exited; the server must be restarted",
                           None, "engine_dead")  # fmt: skip
        if state.stopping:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           {"Retry-After": "5"})  # fmt: skip
        if not state.ready.is_set():
            why = state.warmup_error or "the engine is warming up"
            raise APIError(503, why, None, "not_ready", {"Retry-After": "1"})

    async def generate(
        body: Any, request: Request, translate: Any
    ) -> tuple[list[GenerationResult], float]:
        """The shared part of both generation routes: checks, tokenize, run, metrics. Returns
        the results and when they reached the route (`shaped` observes the time after it)."""
        check_model(body.model)
        check_serving()
        if _translate_inline(request, body):
            gens = translate(engine, body, defaults)
        else:
            gens = await run_in_threadpool(translate, engine, body, defaults)
        filters = [g.item_filter for g in gens if g.item_filter is not None]
        state.metrics.filtered.inc(len(filters))
        state.metrics.filtered_sids.inc(sum(f.num_closed for f in filters))
        timeout = body.timeout or defaults.timeout_s
        submitted = time.perf_counter()
        results = await _run_requests(engine, request, gens, timeout)
        returned = time.perf_counter()
        state.metrics.observe_stage("intake", submitted - request.state.received_at)
        for r in results:
            state.metrics.observe_stages(r.timings)
        return results, returned

    def shaped(response: Response, returned: float) -> Response:
        """`response`, its shaping time observed (a stream's chunks are encoded as sent)."""
        state.metrics.observe_stage("shaping", time.perf_counter() - returned)
        return response

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED,
              dependencies=guard)  # fmt: skip
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        [result], returned = await generate(body, request, lambda e, b, d: [chat_request(e, b, d)])
        shaping = responses.Shaping.of(body, result.requested)
        payload = responses.chat_completion(
            responses.new_id("chatcmpl"), settings.model_name, result, shaping
        )
        state.metrics.deduplicated.inc(payload["flashrec"].get("deduplicated_items", 0))
        response = _sse(responses.chat_stream_chunks(payload)) if body.stream else JSON(payload)
        return shaped(response, returned)

    @app.post("/v1/completions", response_model=Completion, responses=STREAMED,
              dependencies=guard)  # fmt: skip
    async def completions(body: CompletionRequest, request: Request) -> Response:
        results, returned = await generate(body, request, completion_requests)
        shaping = responses.Shaping.of(body, results[0].requested)
        payload = responses.completion(
            responses.new_id("cmpl"), settings.model_name, results, shaping
        )
        state.metrics.deduplicated.inc(payload["flashrec"].get("deduplicated_items", 0))
        stream = body.stream
        response = _sse(responses.completion_stream_chunks(payload)) if stream else JSON(payload)
        return shaped(response, returned)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]},
             dependencies=guard)  # fmt: skip
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(engine, settings, state.facts)]}

    @app.get("/v1/catalogs", response_model=CatalogList, responses={401: ERRORS[401]},
             dependencies=guard)  # fmt: skip
    async def catalogs() -> dict[str, Any]:
        if isinstance(engine, RemoteEngine):  # the engine's view: device bytes, live versions
            return {"object": "list", **await run_in_threadpool(engine.loop.command, "catalogs")}
        return {
            "object": "list",
            "data": [v.describe() for v in engine.catalogs.current()],
            "live_versions": [v.describe() for v in engine.catalogs.live()],
        }

    @app.post("/v1/catalogs/{name}", response_model=CatalogInfo, dependencies=guard,
              responses={400: ERRORS[400], 401: ERRORS[401]})  # fmt: skip
    async def put_catalog(
        body: CatalogUpload, name: str = Path(pattern=CATALOG_NAME, max_length=64)
    ) -> dict[str, Any]:
        """Load a catalog as the new version of `name`, built off the engine thread; requests
        in flight finish on the version they started with."""
        version = await run_in_threadpool(_load_catalog, engine, name, body, settings.warmup_n)
        logger.info("catalog %s: version %d from %s", name, version.version, version.source)
        return version.describe()

    @app.delete("/v1/catalogs/{name}", response_model=CatalogInfo,
                dependencies=guard, responses=ERRORS)  # fmt: skip
    async def delete_catalog(name: str) -> dict[str, Any]:
        try:
            removed = engine.catalogs.remove(name).describe()
        except CatalogNotFoundError as exc:
            raise APIError(404, exc.args[0], "name", "catalog_not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "name", "invalid_value") from None
        if isinstance(engine, RemoteEngine):
            return await run_in_threadpool(engine.loop.command, "remove_catalog", name)
        return removed

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Response:
        if _engine_gone(engine):  # a supervisor's liveness probe restarts the server
            return JSON({"status": "engine process exited"}, 503)
        return JSON({"status": "ok"})

    @app.get("/ready", response_model=Health, responses={503: {"model": Health}})
    async def ready() -> Response:
        if _engine_gone(engine):
            return JSON({"status": "engine process exited"}, 503)
        if state.stopping:
            return JSON({"status": "stopping"}, 503, {"Retry-After": "5"})
        if not state.ready.is_set():
            return JSON({"status": "loading"}, 503, {"Retry-After": "1"})
        return JSON({"status": "ready"})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        # a worker thread: with an engine process, its stats are a round trip through the pipe
        body = await run_in_threadpool(generate_latest, state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if settings.torch_profile_dir is not None:
        _add_profile_routes(app, engine, settings.torch_profile_dir, guard)


def _engine_gone(engine: Served) -> bool:
    """The engine process has exited (it never does while the server runs, unless it crashed or
    was killed)."""
    return isinstance(engine, RemoteEngine) and not engine.loop.running


def _add_profile_routes(
    app: FastAPI, engine: Served, directory: FilePath, guard: list[Any]
) -> None:
    """POST /start_profile and /stop_profile (as vLLM and SGLang name them): a torch.profiler
    window over the engine thread, opened and closed at step boundaries (engine/trace.py)."""
    conflict = {409: {"model": ErrorResponse, "description": "already running / not running"}}

    def run(action: Any) -> Any:
        try:
            return action()
        except TraceStateError as exc:
            raise APIError(409, str(exc), None, "profile_state") from None

    @app.post("/start_profile", response_model=ProfileStatus, dependencies=guard,
              responses={**conflict, 401: ERRORS[401]})  # fmt: skip
    async def start_profile() -> dict[str, Any]:
        await run_in_threadpool(run, engine.loop.start_trace)
        logger.info("torch profile started")
        return {"status": "profiling"}

    @app.post("/stop_profile", response_model=ProfileStatus, dependencies=guard,
              responses={**conflict, 401: ERRORS[401]})  # fmt: skip
    async def stop_profile() -> dict[str, Any]:
        trace, summary = await run_in_threadpool(run, lambda: engine.loop.stop_trace(directory))
        logger.info("torch profile written to %s (summary %s)", trace, summary)
        return {"status": "stopped", "trace": str(trace), "summary": str(summary)}


_LAG_PROBE_S = 0.1
"""How often the lag probe wakes. At 10 ms the probe was 7% of the HTTP thread's GIL time under
load (py-spy --gil on the CPU machine): a GIL share the engine thread pays for."""


async def _watch_event_loop_lag(metrics: ServerMetrics) -> None:
    """How late the event loop wakes from a 100 ms sleep: time it could not run because a
    callback (or another thread holding the GIL, the engine's) kept it. A lag of tens of ms
    delays every request's parsing and answer by as much."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(_LAG_PROBE_S)
        metrics.event_loop_lag.observe(max(0.0, loop.time() - start - _LAG_PROBE_S))


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects. Event-driven (the body is read already, so the next
    ASGI message is the disconnect): polling every request would keep the event loop thread
    busy and take the GIL from the engine thread under load."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _run_requests(
    engine: Served, request: Request, reqs: Sequence[GenerationRequest], timeout: float | None
) -> list[GenerationResult]:
    """Submit to the loop and await every result; a client that goes away cancels them."""
    rid = request.state.request_id if hasattr(request.state, "request_id") else None
    handles: list[Any] = []
    try:
        for r in reqs:
            handles.append(engine.loop.submit(r, timeout=timeout, request_id=rid))
    except (QueueFullError, EngineStoppedError, RequestRejectedError) as exc:
        _cancel(engine, handles, "a sibling prompt was refused")
        raise _api_error(exc) from None
    futures = [asyncio.wrap_future(h.future) for h in handles]
    results = asyncio.gather(*futures, return_exceptions=True)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not results.done():
        results.cancel()
        _cancel(engine, handles, "the client disconnected")
        raise ClientGone()
    try:
        return [f.result() for f in futures]
    except (
        QueueFullError, EngineStoppedError, RequestRejectedError, RequestTimeoutError,
        RequestCancelledError, DeviceMemoryError,
    ) as exc:  # fmt: skip
        if not isinstance(exc, RequestCancelledError):
            _cancel(engine, handles, "a sibling prompt failed")
        raise _api_error(exc) from None


def _api_error(exc: Exception) -> APIError:
    """The HTTP answer to an engine error, raised at submission or by the request's future
    (with an engine process, a refusal there arrives through the future)."""
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), None, "queue_full", {"Retry-After": "1"})
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), None, "shutting_down", {"Retry-After": "5"})
    if isinstance(exc, RequestRejectedError):  # translate checked already; the pool may shrink
        return APIError(400, str(exc), exc.param, "invalid_value")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, f"{exc}; raise `timeout` or retry", "timeout", "timeout")
    if isinstance(exc, RequestCancelledError):
        return APIError(503, str(exc), None, "cancelled", {"Retry-After": "5"})
    if isinstance(exc, DeviceMemoryError):
        if exc.retry:
            return APIError(503, str(exc), None, "device_out_of_memory", {"Retry-After": "1"})
        return APIError(400, str(exc), exc.param, "request_too_large")
    raise exc


class ClientGone(APIError):
    """The client went away; nobody reads the answer (nginx's 499 in logs and metrics)."""

    def __init__(self) -> None:
        super().__init__(499, "client closed the request", None, "client_closed_request")


def _cancel(engine: Served, handles: Sequence[Any], reason: str) -> None:
    for h in handles:
        h.cancel(reason)
    engine.loop.wake()


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield b"data: " + dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _model_card(engine: Served, settings: ServerSettings, facts: dict[str, Any]) -> dict[str, Any]:
    catalog = engine.catalog
    limits = engine.loop.limits
    assert limits is not None, "the engine has started"
    return {
        "id": settings.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "flashrec",
        "root": settings.engine.model_path,
        "max_model_len": min(limits.max_context, limits.max_position - limits.depth),
        "flashrec": {
            "architectures": facts["architectures"],
            "sid_depth": limits.depth,
            "level_sizes": list(engine.layout.level_sizes),
            "catalog_sids": len(catalog) if catalog is not None else None,
            "catalog_items": catalog.num_items if catalog is not None else None,
            "max_beam_rows": limits.max_wave_rows,
            "roofline": facts["roofline"],
        },
    }


CATALOG_NAME = r"^[A-Za-z0-9._-]{1,64}$"


def _load_catalog(
    engine: Served, name: str, body: CatalogUpload, warm_widths: Sequence[int]
) -> CatalogVersion:
    """A catalog from a server-side path or the uploaded object (written to a temporary file,
    so both go through the same loader and its checks). The new version's graphs are warmed
    before the swap (no capture storm on the first requests after it)."""
    if (body.path is None) == (body.catalog is None):
        raise APIError(400, "send exactly one of `path` or `catalog`", "path", "invalid_value")

    def add(path: str) -> CatalogVersion:
        if not isinstance(engine, RemoteEngine):
            return engine.add_catalog(name, path, lambda v: warm_catalog(engine, v, warm_widths))[0]
        version = engine.load_catalog_version(name, path)  # checked here first: a 400 if bad
        engine.loop.add_catalog(version)  # the engine process loads and warms it, then serves it
        engine.catalogs.put(version)
        return version

    try:
        if body.path is not None:
            version = add(body.path)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"{name}.json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(body.catalog, f)
                version = add(path)
    except (ValueError, OSError) as exc:  # CatalogError is a ValueError; a missing file
        param = "path" if body.path is not None else "catalog"
        raise APIError(
            400, f"catalog {name!r} was not loaded: {exc}", param, "bad_catalog"
        ) from None
    freeze_long_lived(collect=False)  # the new catalog's item tuples, as at start-up
    return version


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashrec-core")
    except PackageNotFoundError:
        return "0+unknown"
