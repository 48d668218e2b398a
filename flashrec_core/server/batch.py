"""Offline batch through the engine loop: `flashrec generate --input requests.jsonl --output
results.jsonl`.

Each input line is an API request body (chat when it has `messages`, completions when it has
`prompt`), or an OpenAI Batch API line (`{"custom_id", "url", "body"}`). Each output line is
`{"line", "custom_id", "status_code", "response"}` or, for a line that fails,
`{"line", "custom_id", "status_code", "error"}` with the same error object the server sends:
a bad line never stops the run. Lines are checked, submitted in chunks, and written in input
order as their chunk finishes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from tqdm import tqdm

from flashrec_core.engine.engine import Engine
from flashrec_core.engine.handles import DeviceMemoryError
from flashrec_core.engine.loop import wait_done
from flashrec_core.server import responses
from flashrec_core.server.encoding import dumps
from flashrec_core.server.errors import APIError, field_path
from flashrec_core.server.protocol import ChatCompletionRequest, CompletionRequest
from flashrec_core.server.translate import Defaults, chat_request, completion_requests

CHUNK_LINES = 1024  # lines in flight at once: bounds host memory, keeps waves full


@dataclass(frozen=True)
class BatchSummary:
    ok: int
    failed: int


@dataclass
class _Line:
    number: int
    custom_id: str | None
    kind: str = ""
    handles: list[Any] | None = None
    error: APIError | None = None
    shaping: responses.Shaping = responses.Shaping()


def run_batch(
    engine: Engine, src: Path, dst: Path | None, defaults: Defaults, model: str
) -> BatchSummary:
    if not src.is_file():
        raise FileNotFoundError(f"--input {src} does not exist")
    ok = failed = 0
    with _open_out(dst) as out, tqdm(desc="batch", unit="req", disable=dst is None) as bar:
        for chunk in _chunks(_read_lines(src)):
            lines = [_submit(engine, number, text, defaults) for number, text in chunk]
            wait_done(engine.loop, [h for line in lines for h in line.handles or ()])
            for line in lines:
                record = _finish(line, model)
                out.write(dumps(record).decode() + "\n")
                ok += record["status_code"] == 200
                failed += record["status_code"] != 200
                bar.update(1)
    return BatchSummary(ok, failed)


def _open_out(dst: Path | None) -> TextIO:
    if dst is None:
        return _Stdout()
    try:
        return dst.open("w", encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--output {dst}: {exc.strerror}") from None


class _Stdout:
    def __enter__(self) -> TextIO:
        return sys.stdout

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()


def _read_lines(src: Path) -> Iterator[tuple[int, str | UnicodeDecodeError]]:
    with src.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, exc


def _chunks(lines: Iterator[tuple[int, Any]]) -> Iterator[list[tuple[int, Any]]]:
    chunk: list[tuple[int, Any]] = []
    for item in lines:
        chunk.append(item)
        if len(chunk) == CHUNK_LINES:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _submit(engine: Engine, number: int, text: Any, defaults: Defaults) -> _Line:
    line = _Line(number, None)
    try:
        if isinstance(text, UnicodeDecodeError):
            raise APIError(400, f"line {number} is not UTF-8 ({text.reason} at byte {text.start})")
        body, line.custom_id, line.kind = _parse(number, text)
        if line.kind == "chat":
            parsed: Any = ChatCompletionRequest.model_validate(body)
            reqs = [chat_request(engine, parsed, defaults)]
        else:
            parsed = CompletionRequest.model_validate(body)
            reqs = completion_requests(engine, parsed, defaults)
        line.shaping = responses.Shaping.of(parsed, reqs[0].n)
        line.handles = [engine.loop.submit(r, bounded=False) for r in reqs]
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(first["loc"])
        line.error = APIError(400, f"line {number}: {param or 'body'}: {first['msg']}", param)
    except APIError as exc:
        line.error = exc
    except ValueError as exc:
        line.error = APIError(400, f"line {number}: {exc}")
    return line


def _parse(number: int, text: str) -> tuple[dict[str, Any], str | None, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"line {number} is not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"line {number}: expected a JSON object")
    custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) else None
    body = data["body"] if isinstance(data.get("body"), dict) else data
    url = data.get("url") if "body" in data else None
    if url == "/v1/chat/completions" or (url is None and "messages" in body):
        return body, custom_id, "chat"
    if url == "/v1/completions" or (url is None and "prompt" in body):
        return body, custom_id, "completion"
    raise APIError(400, f"line {number}: a request needs `messages` (chat) or `prompt`", None)


def _finish(line: _Line, model: str) -> dict[str, Any]:
    record: dict[str, Any] = {"line": line.number, "custom_id": line.custom_id}
    if line.error is None:
        try:
            results = [h.future.result() for h in line.handles or ()]
        except DeviceMemoryError as exc:  # offline: no later retry, the line cannot fit
            line.error = APIError(400, f"line {line.number}: {exc}", exc.param, "request_too_large")
        except Exception as exc:  # the engine failed this request: an error line, go on
            line.error = APIError(500, f"line {line.number}: {exc}")
        else:
            if line.kind == "chat":
                body = responses.chat_completion(
                    responses.new_id("chatcmpl"), model, results[0], line.shaping
                )
            else:
                body = responses.completion(responses.new_id("cmpl"), model, results, line.shaping)
            return {**record, "status_code": 200, "response": body}
    err = line.error
    assert err is not None, "a line either has handles or an error"
    error = {"message": err.message, "type": "invalid_request_error", "param": err.param,
             "code": err.code}  # fmt: skip
    return {**record, "status_code": err.status, "error": error}
