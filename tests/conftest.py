"""Runs first for every test under tests/: without CUDA, Triton kernels run in the interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, and some imports (torch._dynamo, used
by the trie's capture-safety test) pull triton in, so the variable is set here, before any test
module is collected. On CUDA it stays unset, or the kernels would run interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """FLASHREC_INSTANT_FAILURES=1: print each failure as it happens (GPU runs are cut off by a
    time limit before pytest's summary would print)."""
    if report.failed and os.environ.get("FLASHREC_INSTANT_FAILURES") == "1":
        print(f"\n!!! {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}", flush=True)
