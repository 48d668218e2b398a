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
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (`wait_ready` waits)."""
        cmd = [sys.executable, "-m", "flashrec_core.cli", *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)

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

    def children(self) -> list[int]:
        """The server's live child processes (the engine process by default), from /proc."""
        assert self.proc is not None, "started"
        return [pid for pid in _live_pids() if _parent(pid) == self.proc.pid]

    def find_engine_pid(self) -> int | None:
        """The engine process (the child running multiprocessing's spawn), if there is one."""
        spawned = (pid for pid in self.children() if b"spawn_main" in _read(f"/proc/{pid}/cmdline"))
        return next(spawned, None)

    def engine_pid(self) -> int:
        pid = self.find_engine_pid()
        if pid is None:
            raise AssertionError("no engine process under the server (--no-engine-process?)")
        return pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited; it only waits for its parent to reap it)."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def pids_with_env(variable: str) -> list[int]:
    """Live processes whose environment holds `variable` (NAME=VALUE): a server's children
    inherit it, so it finds them after the server has gone."""
    return [
        pid
        for pid in _live_pids()
        if variable.encode() in _read(f"/proc/{pid}/environ").split(b"\0")
    ]


def _live_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and alive(int(e))]


def _parent(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else -1


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


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
