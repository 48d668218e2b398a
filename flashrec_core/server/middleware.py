"""A pure-ASGI middleware (not BaseHTTPMiddleware, which breaks disconnect detection and
streaming): a request id per request, one log line, and the request counters and latency.

The request id is the client's `X-Request-Id` when it sends one, else a new one; it is echoed in
the response's `X-Request-Id` and carried by the engine handle and the log line.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashrec_core.server.metrics import ServerMetrics

logger = logging.getLogger("flashrec.server")
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/catalogs", "/health",
             "/ready", "/metrics"}  # fmt: skip


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, enabled: bool = True) -> None:
        self.app, self.metrics, self.enabled = app, metrics, enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given and _ID.match(given) else uuid.uuid4().hex
        start = time.perf_counter()
        # the arrival time, for the routes' intake stage (the server's own time before the engine)
        scope.setdefault("state", {}).update(request_id=rid, received_at=start)
        status = 500  # if the app raises before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}  # fmt: skip
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            seconds = time.perf_counter() - start
            endpoint = (
                path
                if path in ENDPOINTS
                else ("/v1/catalogs/{name}" if path.startswith("/v1/catalogs/") else "other")
            )
            self.metrics.observe(endpoint, status, seconds)
            if self.enabled and endpoint not in ("/metrics", "/health", "/ready"):
                logger.info("%s %s %s %d %.1f ms", rid, scope.get("method"), path, status,
                            seconds * 1e3)  # fmt: skip


def _header(scope: Scope, name: bytes) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for k, v in headers:
        if k.lower() == name:
            try:
                return v.decode("latin-1")
            except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any bytes
                return None
    return None


__all__: list[Any] = ["RequestLogMiddleware"]
