"""torch.profiler windows over the engine loop (the server's /start_profile and /stop_profile).

A window records the engine thread's torch operations and, on a GPU, every kernel and copy,
with one range per loop phase (`flashrec.retire`, `flashrec.step`, `flashrec.admit`,
`flashrec.results`) inside one `flashrec.iteration` range, so a trace taken under load shows
what each iteration spent where (bench/trace_summary.py sums it up). The profiler starts and
stops on the engine thread: torch records the operations of the thread that enabled it.
Outside a window the phase ranges cost nothing (`phase` hands out a null context).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class TraceStateError(RuntimeError):
    """Start while a window is open, or stop without one."""


class LoopTrace:
    """At most one open profiler window at a time."""

    def __init__(self) -> None:
        self._profiler: profile | None = None
        self._started_at = 0.0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        """Open a window (on the thread whose operations it should record)."""
        if self._profiler is not None:
            raise TraceStateError("a profile is already running: stop it first (/stop_profile)")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        prof.start()
        self._profiler, self._started_at = prof, time.time()

    def close(self) -> tuple[profile, float]:
        """Close the window (on the thread that opened it); the stopped profiler and when the
        window opened, for `write`."""
        prof = self._profiler
        if prof is None:
            raise TraceStateError("no profile is running: start one first (/start_profile)")
        self._profiler = None
        prof.stop()
        return prof, self._started_at

    @staticmethod
    def write(prof: profile, started_at: float, directory: Path) -> tuple[Path, Path]:
        """Write a closed window's Chrome trace (gzipped JSON, chrome://tracing or
        https://ui.perfetto.dev) and a text table of the operations by their own time into
        `directory`; both paths. Any thread: a GPU window under load holds hundreds of
        thousands of events, and exporting them must not stall the engine thread."""
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at))
        base = directory / f"flashrec-{stamp}-{int(started_at * 1000) % 1000:03d}"
        trace = base.with_name(base.name + ".trace.json.gz")
        summary = base.with_name(base.name + ".txt")
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        summary.write_text(prof.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        return trace, summary

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A named range in the open window; a null context without one."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return record_function(f"flashrec.{name}")
