"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every way a client can get a request wrong maps to a 4xx here (validation, auth, unknown model
or route, a full queue, a deadline), so no client input reaches a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashrec_core.engine.handles import EngineStoppedError

logger = logging.getLogger("flashrec.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client (status, message, and the request field at fault)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def field_path(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]"):
            continue  # union branch names pydantic adds to the location
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    # the most specific problem: in a union, the branch that got furthest names the real field
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
    if first.get("type") == "json_invalid":
        return (
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
            None,
        )
    param = field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unrecognized request argument"
    if first.get("type") == "missing":
        msg = "required field is missing"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {msg}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineStoppedError)
    async def _engine_gone(_: Request, exc: EngineStoppedError) -> JSONResponse:
        # a command to an engine process that has exited (catalogs, profiler): not the client's
        # fault, and not a 500 either
        return error_response(503, str(exc), None, "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; see GET /v1/models, docs/api.md"
            )
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, message, None, code, dict(exc.headers or {}))
