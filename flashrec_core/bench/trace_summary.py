"""Where the engine loop's iterations went, from a trace of `flashrec serve`'s /stop_profile
or of `flashrec bench --engine --trace-dir`.

For each `flashrec.<phase>` range of the engine thread (engine/trace.py) it reports the host
time a loop iteration spent in the phase and the GPU time of the kernels and copies launched
from it (matched through their CUDA correlation ids, CUDA graph replays included), and for the
whole window how busy the GPU was: whether an iteration is bound by the host or the device,
and by which phase. Also per phase: the host-to-device copies from pageable memory it issued
(staged by the driver on the host thread; pinned memory makes them true async copies), and the
GPU idle time spent waiting for its work (gaps over 20 us before an operation it launched).
Usage:

    python -m flashrec_core.bench.trace_summary TRACE.trace.json.gz [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PREFIX = "flashrec."
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LONG_GAP_US = 20.0
"""GPU idle gaps longer than this are host work the GPU waited for; shorter ones are the
boundaries between kernels (about 1-2 us each, inside CUDA graphs too)."""
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's events (a Chrome trace, gzipped or not)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)["traceEvents"]


def _complete(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _sweep(spans: list[tuple[float, float, Any]]) -> tuple[float, list[tuple[float, Any]]]:
    """Over [start, end) spans, each with a tag: the total length they cover, and the gaps
    between them in order as (gap us, tag of the span that ended the gap)."""
    total, reach, gaps = 0.0, None, []
    for start, end, tag in sorted(spans, key=lambda span: span[0]):
        if reach is not None and start > reach:
            gaps.append((start - reach, tag))
        if reach is None or end > reach:
            total += end - (start if reach is None else max(start, reach))
            reach = end
    return total, gaps


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: host ms and launched GPU ms a loop iteration; the window's GPU busy share;
    the kernels that took the most GPU time."""
    complete = _complete(events)
    ranges = [e for e in complete if str(e.get("name", "")).startswith(PREFIX)]
    iterations = sorted(
        (e for e in ranges if e["name"] == PREFIX + "iteration"), key=lambda e: e["ts"]
    )
    if not iterations:
        raise ValueError("no flashrec.iteration ranges: not a trace of the engine loop's window")
    tid = iterations[0].get("tid")
    starts = [e["ts"] for e in iterations]
    phases = [e for e in ranges if e["name"] != PREFIX + "iteration" and e.get("tid") == tid]
    phases.sort(key=lambda e: e["ts"])
    phase_starts = [p["ts"] for p in phases]  # the phases of an iteration follow each other

    def owner(ts: float) -> tuple[int, str] | None:
        """(iteration index, phase) of a host timestamp on the engine thread."""
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > iterations[i]["ts"] + iterations[i]["dur"]:
            return None
        j = bisect.bisect_right(phase_starts, ts) - 1
        if j >= 0 and ts <= phases[j]["ts"] + phases[j]["dur"]:
            return i, phases[j]["name"][len(PREFIX) :]
        return i, "other"

    launches: dict[Any, tuple[int, str] | None] = {}
    graph_launches: Counter[str] = Counter()
    for e in complete:
        if e.get("cat") in LAUNCH_CATEGORIES and e.get("tid") == tid:
            where = owner(e["ts"])
            launches[(e.get("args") or {}).get("correlation")] = where
            if where is not None and "GraphLaunch" in e["name"]:
                graph_launches[where[1]] += 1
    gpu = [e for e in complete if e.get("cat") in GPU_CATEGORIES]
    gpu_ms: dict[str, float] = defaultdict(float)
    pageable: Counter[str] = Counter()
    by_kernel: Counter[str] = Counter()

    def phase_of(e: dict[str, Any]) -> str:
        where = launches.get((e.get("args") or {}).get("correlation"))
        return where[1] if where is not None else "outside the loop"

    for e in gpu:
        phase = phase_of(e)
        gpu_ms[phase] += e["dur"] / 1e3
        by_kernel[e["name"][:90]] += e["dur"] / 1e3
        if "Pageable" in e["name"] and "HtoD" in e["name"]:
            pageable[phase] += 1
    host_ms: dict[str, float] = defaultdict(float)
    for p in phases:
        host_ms[p["name"][len(PREFIX) :]] += p["dur"] / 1e3
    walls = [e["dur"] / 1e3 for e in iterations]
    host_ms["other"] = max(0.0, sum(walls) - sum(host_ms.values()))
    count = len(iterations)
    lo, hi = iterations[0]["ts"], iterations[-1]["ts"] + iterations[-1]["dur"]
    window_us = hi - lo
    # Busy time inside the window, and the idle gaps, each by the phase that launched the work
    # the GPU then waited for (a gap before an upload of the admission: the host was still
    # building its inputs). Gaps of a few us are kernel boundaries (inside a graph too); longer
    # ones, host work.
    busy, gaps = _sweep(
        [(e["ts"], min(hi, e["ts"] + e["dur"]), phase_of(e)) for e in gpu if lo <= e["ts"] <= hi]
    )
    long_gaps = [(us, phase) for us, phase in gaps if us > LONG_GAP_US]
    idle_by_phase: dict[str, float] = defaultdict(float)
    for us, phase in long_gaps:
        idle_by_phase[phase] += us / 1e3
    names = sorted(set(host_ms) | set(gpu_ms) | set(pageable), key=lambda k: -host_ms.get(k, 0.0))
    return {
        "iterations": count,
        "window_ms": window_us / 1e3,
        "engine_busy_share": sum(walls) * 1e3 / window_us if window_us else 0.0,
        "gpu_busy_share": busy / window_us if gpu and window_us else None,  # None: no GPU
        "iteration_ms": {
            "mean": statistics.fmean(walls),
            "p50": _percentile(walls, 0.5),
            "p99": _percentile(walls, 0.99),
        },
        "phases": {
            k: {
                "host_ms_per_iteration": host_ms.get(k, 0.0) / count,
                "gpu_ms_per_iteration": gpu_ms.get(k, 0.0) / count,
                "graph_launches_per_iteration": graph_launches.get(k, 0) / count,
                "pageable_uploads_per_iteration": pageable.get(k, 0) / count,
                "gpu_idle_before_ms_per_iteration": idle_by_phase.get(k, 0.0) / count,
            }
            for k in names
        },
        "gpu_idle": {
            "long_gaps": len(long_gaps),
            "long_gaps_ms": sum(us for us, _ in long_gaps) / 1e3,
            "short_gaps": len(gaps) - len(long_gaps),
            "short_gaps_ms": sum(us for us, _ in gaps if us <= LONG_GAP_US) / 1e3,
        },
        "top_kernels_ms": dict(by_kernel.most_common(15)),
    }


def format_summary(s: dict[str, Any]) -> str:
    it = s["iteration_ms"]
    gpu = s["gpu_busy_share"]
    idle = s["gpu_idle"]
    lines = [
        f"{s['iterations']} iterations in {s['window_ms']:.1f} ms: engine thread busy "
        f"{s['engine_busy_share']:.0%}, "
        + (f"GPU busy {gpu:.0%}" if gpu is not None else "no GPU activity traced")
        + f"; an iteration "
        f"{it['mean']:.2f} ms mean, p50 {it['p50']:.2f}, p99 {it['p99']:.2f}",
        f"GPU idle gaps over {LONG_GAP_US:.0f} us: {idle['long_gaps']}, "
        f"{idle['long_gaps_ms']:.2f} ms; shorter (kernel boundaries): {idle['short_gaps']}, "
        f"{idle['short_gaps_ms']:.2f} ms",
        f"{'phase':<18}{'host ms/iter':>14}{'GPU ms/iter':>14}{'graph replays/iter':>20}"
        f"{'pageable uploads/iter':>23}{'GPU idle before/iter':>22}",
    ]
    for name, p in s["phases"].items():
        lines.append(
            f"{name:<18}{p['host_ms_per_iteration']:>14.3f}{p['gpu_ms_per_iteration']:>14.3f}"
            f"{p['graph_launches_per_iteration']:>20.2f}"
            f"{p['pageable_uploads_per_iteration']:>23.2f}"
            f"{p['gpu_idle_before_ms_per_iteration']:>22.3f}"
        )
    lines.append("GPU time by kernel (ms in the window):")
    lines += [f"  {ms:9.2f}  {name}" for name, ms in s["top_kernels_ms"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    summary = summarize(load_events(args.trace))
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
