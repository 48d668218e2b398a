"""What latency tail a schedule can reach at a load: a discrete-event model of the engine loop
beside the first-come-first-served bound (docs/architecture.md, "The tail against its bound").

The model: identical requests arrive as a Poisson stream. Each needs a prefill of `prefill_ms`
of GPU time (a wave of k requests costs k times that: 1,024-token prefills are compute-bound)
and then `depth - 1` beam steps, each a model forward of `step_ms` that the waves in flight
share (merged steps). An iteration of the loop steps the waves in flight, then admits every
queued request as one wave (`interleaved`, the default schedule) or admits only when no wave is
in flight (`decode_first`), and costs `host_ms` more. A request is done when its last step ends.

The bound: a GPU that runs only the prefills, first come first served, never stepping (an
M/D/1 queue), then `depth - 1` forwards of `step_ms` after each request's prefill. Every
schedule does at least this work on one GPU, and for identical requests first-come-first-served
is the order with the lightest tail, so no schedule's p99 is under the bound's. The loop admits
in arrival order too, so each of its requests takes at least its own bound
(tests/core/test_latency_model.py).

    python -m flashrec_core.bench.latency_model --rate 140 --prefill-ms 4.6 --step-ms 2.8
"""

from __future__ import annotations

import argparse
import random
from typing import Literal

Schedule = Literal["interleaved", "decode_first"]


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> list[float]:
    """Arrival times in ms of `count` requests at `rate_per_s`."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s / 1000.0)
        times.append(t)
    return times


def bound_latencies(
    arrivals: list[float], prefill_ms: float, step_ms: float, depth: int
) -> list[float]:
    """Each request's lower bound: its prefill's completion on a GPU that runs only prefills,
    first come first served, plus `depth - 1` step forwards."""
    free, out = 0.0, []
    for t in arrivals:
        free = max(t, free) + prefill_ms
        out.append(free - t + (depth - 1) * step_ms)
    return out


def loop_latencies(
    arrivals: list[float],
    schedule: Schedule,
    prefill_ms: float,
    step_ms: float,
    host_ms: float,
    depth: int,
) -> list[float]:
    """Each request's latency under the engine loop's schedule (module docstring)."""
    if depth < 2:
        raise ValueError(f"depth must be at least 2 (a prefill, then a beam step), got {depth}")
    now, next_arrival, out = 0.0, 0, [0.0] * len(arrivals)
    waves: list[tuple[list[int], int]] = []  # (request indices, steps left)
    while next_arrival < len(arrivals) or waves:
        if not waves and arrivals[next_arrival] > now:
            now = arrivals[next_arrival]  # idle until the next arrival
        start = now
        if waves:
            now += step_ms
            stepped = [(ids, left - 1) for ids, left in waves]
            for ids, _ in (w for w in stepped if w[1] == 0):
                for i in ids:
                    out[i] = now - arrivals[i]
            waves = [w for w in stepped if w[1] > 0]
        if schedule == "interleaved" or not waves:
            admitted = []
            while next_arrival < len(arrivals) and arrivals[next_arrival] <= now:
                admitted.append(next_arrival)
                next_arrival += 1
            if admitted:
                now += prefill_ms * len(admitted)
                waves.append((admitted, depth - 1))
        if now > start:
            now += host_ms
    return out


def unloaded_latency(prefill_ms: float, step_ms: float, host_ms: float, depth: int) -> float:
    """A request's latency under the loop when it runs alone: its prefill, then `depth - 1`
    steps, each of the first `depth - 1` iterations adding its host time."""
    return prefill_ms + (depth - 1) * (step_ms + host_ms)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, required=True, help="arrivals a second")
    parser.add_argument(
        "--prefill-ms", type=float, required=True, help="GPU time of a request's prefill"
    )
    parser.add_argument(
        "--step-ms", type=float, required=True, help="GPU time of a merged beam step"
    )
    parser.add_argument("--host-ms", type=float, default=0.2, help="host time an iteration adds")
    parser.add_argument("--depth", type=int, default=3, help="SID levels")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    arrivals = poisson_arrivals(args.rate, args.requests, args.seed)
    unloaded = unloaded_latency(args.prefill_ms, args.step_ms, args.host_ms, args.depth)
    rows = {"FCFS bound": bound_latencies(arrivals, args.prefill_ms, args.step_ms, args.depth)}
    for schedule in ("interleaved", "decode_first"):
        rows[schedule] = loop_latencies(
            arrivals, schedule, args.prefill_ms, args.step_ms, args.host_ms, args.depth
        )
    print(
        f"load {args.rate * args.prefill_ms / 1000:.2f} of the GPU in prefills; unloaded {unloaded:.1f} ms"
    )
    for name, lat in rows.items():
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        print(f"{name:12s} p50 {p50:6.1f} ms  p99 {p99:6.1f} ms  ({p99 / unloaded:.1f}x unloaded)")


if __name__ == "__main__":
    main()
