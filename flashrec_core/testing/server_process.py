"""A real `flashrec serve` process on 127.0.0.1 and a free port, for tests and benchmarks.

with ServerProcess(["--model-path", DIR, "--catalog", FILE]) as server:
    httpx.get(server.url + "/ready")

Started with the same Python, waited for until /ready answers 200 (its log is in the exception
when it never does), stopped with SIGTERM on exit (then killed if it does not exit in time).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", *args, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(
            prefix="flashrec-serve-", suffix=".log", delete=False
        )

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "flashrec_core.cli", *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def wait_ready(self) -> None:
        end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"flashrec serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(
            f"flashrec serve not ready after {self.ready_timeout_s} s:\n{self.log()}"
        )

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM: the server drains requests in flight and exits."""
        assert self.proc is not None, "started"
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None, "started"
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def read_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of GET /metrics as {"name{label=value,...}": value} (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
