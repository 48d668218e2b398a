"""The trace summary's bookkeeping on a hand-made trace: which phase launched which kernel
(through CUDA correlation ids), host and GPU time per iteration, and the GPU's busy share."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flashrec_core.bench.trace_summary import format_summary, load_events, summarize

ENGINE, HTTP = 7, 9  # thread ids


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = ENGINE,
       **args: object) -> dict:  # fmt: skip
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _iteration(t0: float, corr: int) -> list[dict]:
    """A 10 us iteration: step 0-4 (one graph replay -> 2 kernels of 3 us), admit 5-8 (one
    launch -> a 6 us kernel), results 8-9; 1 us outside any phase."""
    return [
        _x("flashrec.iteration", t0, 10),
        _x("flashrec.step", t0, 4),
        _x("cudaGraphLaunch", t0 + 1, 1, "cuda_runtime", correlation=corr),
        _x("k_step_a", t0 + 2, 3, "kernel", tid=0, correlation=corr),
        _x("k_step_b", t0 + 5, 3, "kernel", tid=0, correlation=corr),
        _x("flashrec.admit", t0 + 5, 3),
        _x("cudaLaunchKernel", t0 + 6, 1, "cuda_runtime", correlation=corr + 1),
        _x("k_prefill", t0 + 8, 6, "kernel", tid=0, correlation=corr + 1),
        _x("flashrec.results", t0 + 8, 1),
    ]


def test_summary_attributes_gpu_time_to_the_launching_phase(tmp_path: Path) -> None:
    events = _iteration(0, 1) + _iteration(20, 11)
    # a launch on another thread, and its kernel: outside the loop
    events += [_x("cudaLaunchKernel", 3, 1, "cuda_runtime", tid=HTTP, correlation=99),
               _x("k_other", 15, 2, "kernel", tid=0, correlation=99)]  # fmt: skip
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    s = summarize(load_events(path))
    assert s["iterations"] == 2 and s["window_ms"] == pytest.approx(0.030)
    assert s["engine_busy_share"] == pytest.approx(20 / 30)
    # kernels cover 2-14, 15-17 and 22-34, cut to the 0-30 window
    assert s["gpu_busy_share"] == pytest.approx((12 + 2 + 8) / 30)
    phases = s["phases"]
    assert phases["step"] == {
        "host_ms_per_iteration": pytest.approx(0.004),
        "gpu_ms_per_iteration": pytest.approx(0.006),
        "graph_launches_per_iteration": 1.0,
        "pageable_uploads_per_iteration": 0.0,
        "gpu_idle_before_ms_per_iteration": 0.0,
    }
    # idle 14-15 (before k_other) and 17-22 (before the second step): kernel boundaries
    assert s["gpu_idle"] == {"long_gaps": 0, "long_gaps_ms": 0.0, "short_gaps": 2,
                             "short_gaps_ms": pytest.approx(0.006)}  # fmt: skip
    assert phases["admit"]["gpu_ms_per_iteration"] == pytest.approx(0.006)
    assert phases["admit"]["graph_launches_per_iteration"] == 0.0
    assert phases["results"]["host_ms_per_iteration"] == pytest.approx(0.001)
    assert phases["other"]["host_ms_per_iteration"] == pytest.approx(0.002)
    assert phases["outside the loop"]["gpu_ms_per_iteration"] == pytest.approx(0.001)
    assert s["top_kernels_ms"]["k_prefill"] == pytest.approx(0.012)
    assert "2 iterations" in format_summary(s)


def test_idle_gpu_is_charged_to_the_phase_whose_work_it_waited_for() -> None:
    """An iteration whose admission built its inputs for 40 us with the GPU drained: the
    upload that ended the wait is a pageable copy the admission issued."""
    events = [
        _x("flashrec.iteration", 0, 100),
        _x("flashrec.step", 0, 10),
        _x("cudaGraphLaunch", 1, 1, "cuda_runtime", correlation=1),
        _x("k_step", 2, 8, "kernel", tid=0, correlation=1),
        _x("flashrec.admit", 10, 80),
        _x("cudaMemcpyAsync", 49, 1, "cuda_runtime", correlation=2),
        _x("Memcpy HtoD (Pageable -> Device)", 50, 2, "gpu_memcpy", tid=0, correlation=2),
        _x("cudaMemcpyAsync", 52, 1, "cuda_runtime", correlation=3),
        _x("Memcpy HtoD (Pinned -> Device)", 53, 1, "gpu_memcpy", tid=0, correlation=3),
        _x("cudaLaunchKernel", 60, 1, "cuda_runtime", correlation=4),
        _x("k_prefill", 61, 30, "kernel", tid=0, correlation=4),
    ]
    s = summarize(events)
    admit, step = s["phases"]["admit"], s["phases"]["step"]
    assert admit["pageable_uploads_per_iteration"] == 1.0  # the pinned copy does not count
    assert admit["gpu_idle_before_ms_per_iteration"] == pytest.approx(0.040)  # 10 -> 50 us
    assert step["gpu_idle_before_ms_per_iteration"] == 0.0
    # 52 -> 53 and 54 -> 61: under the 20 us of a long gap
    assert s["gpu_idle"] == {"long_gaps": 1, "long_gaps_ms": pytest.approx(0.040),
                             "short_gaps": 2, "short_gaps_ms": pytest.approx(0.008)}  # fmt: skip
    text = format_summary(s)
    assert "GPU idle gaps over 20 us: 1, 0.04 ms" in text and "pageable uploads/iter" in text


def test_a_trace_without_gpu_activity_says_so() -> None:
    s = summarize([_x("flashrec.iteration", 0, 10), _x("flashrec.step", 1, 5)])
    assert s["gpu_busy_share"] is None and "no GPU activity traced" in format_summary(s)


def test_a_trace_without_loop_ranges_is_refused() -> None:
    with pytest.raises(ValueError, match="no flashrec.iteration ranges"):
        summarize([_x("cudaLaunchKernel", 0, 1, "cuda_runtime", correlation=1)])
