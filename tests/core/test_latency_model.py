"""The latency model (flashrec_core/bench/latency_model.py): its FCFS bound is the M/D/1 queue,
its loop serves a lone request in the unloaded time, and no request beats its bound."""

from __future__ import annotations

import statistics

import pytest

from flashrec_core.bench.latency_model import (
    bound_latencies,
    loop_latencies,
    poisson_arrivals,
    unloaded_latency,
)


def test_bound_is_the_md1_queue() -> None:
    # Pollaczek-Khinchine: an M/D/1 queue at load rho waits rho * S / (2 (1 - rho)) on average,
    # 0.5 ms at rho = 0.5 and S = 1 ms. Over 200,000 arrivals, eight seeds came within 0.7% of
    # it; 3% leaves four times that and still fails a queue that, say, drops the max(t, free).
    arrivals = poisson_arrivals(500.0, 200_000, seed=3)
    waits = [lat - 1.0 for lat in bound_latencies(arrivals, prefill_ms=1.0, step_ms=0.0, depth=1)]
    assert statistics.fmean(waits) == pytest.approx(0.5, rel=0.03)


@pytest.mark.parametrize("schedule", ["interleaved", "decode_first"])
def test_a_lone_request_takes_the_unloaded_time(schedule: str) -> None:
    arrivals = [0.0, 1000.0, 2000.0]  # far apart: each finds the loop idle
    lat = loop_latencies(arrivals, schedule, prefill_ms=4.6, step_ms=2.8, host_ms=0.2, depth=3)
    assert lat == pytest.approx([unloaded_latency(4.6, 2.8, 0.2, 3)] * 3)


@pytest.mark.parametrize("schedule", ["interleaved", "decode_first"])
def test_no_request_beats_its_bound(schedule: str) -> None:
    arrivals = poisson_arrivals(140.0, 20_000, seed=1)
    bound = bound_latencies(arrivals, prefill_ms=4.6, step_ms=2.8, depth=3)
    lat = loop_latencies(arrivals, schedule, prefill_ms=4.6, step_ms=2.8, host_ms=0.2, depth=3)
    assert all(b <= x + 1e-9 for b, x in zip(bound, lat))
    assert statistics.fmean(lat) > statistics.fmean(bound)  # the loop's batching costs something


def test_a_depth_without_beam_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="depth must be at least 2"):
        loop_latencies([0.0], "interleaved", prefill_ms=1.0, step_ms=1.0, host_ms=0.0, depth=1)
