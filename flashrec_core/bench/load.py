"""Load generator for a running `flashrec serve`: open-loop Poisson arrivals at given rates, a
closed-loop saturation run, and unloaded single-request latency.

Open loop: each request is sent at its arrival time whether or not earlier ones have finished
(as real traffic arrives), so queueing shows in the latency instead of slowing the sender down.
Requests go to /v1/completions with token-id prompts (the synthetic bench's prompts), so the
server tokenizes nothing; latencies are client wall-clock (HTTP, JSON and queueing included).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np


def completion_bodies(prompts: Sequence[Sequence[int]], n: int) -> list[dict[str, Any]]:
    return [{"prompt": list(p), "n": n, "max_tokens": 3} for p in prompts]


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int]:
    start = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    if r.status_code == 200:
        r.json()  # a client reads the answer
    return time.perf_counter() - start, r.status_code


def _client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits)


def _summary(latencies: list[float], codes: list[int], seconds: float) -> dict[str, Any]:
    ok = [lat for lat, c in zip(latencies, codes) if c == 200]
    return {
        "sent": len(codes),
        "errors": sum(c != 200 for c in codes),
        "throughput_rps": len(ok) / seconds if seconds > 0 else 0.0,
        "latency_p50_ms": 1e3 * float(np.percentile(ok, 50)) if ok else None,
        "latency_p99_ms": 1e3 * float(np.percentile(ok, 99)) if ok else None,
    }


async def open_loop(
    url: str, bodies: Sequence[dict[str, Any]], rate: float, api_key: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Send `bodies` at Poisson arrivals of `rate` requests/s."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(bodies))
    async with _client(url, api_key, connections=len(bodies)) as client:
        start = time.perf_counter()
        tasks = []
        for body, at in zip(bodies, np.cumsum(gaps)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_post(client, body)))
        done = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    out = _summary([d[0] for d in done], [d[1] for d in done], seconds)
    return {"offered_rps": rate, **out}


async def closed_loop(
    url: str, bodies: Sequence[dict[str, Any]], concurrency: int, api_key: str | None = None
) -> dict[str, Any]:
    """`concurrency` requests always in flight: the server's saturated throughput."""
    queue = list(bodies)
    latencies: list[float] = []
    codes: list[int] = []
    async with _client(url, api_key, connections=concurrency) as client:

        async def worker() -> None:
            while queue:
                lat, code = await _post(client, queue.pop())
                latencies.append(lat)
                codes.append(code)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {"concurrency": concurrency, **_summary(latencies, codes, seconds)}


async def unloaded(
    url: str, bodies: Sequence[dict[str, Any]], api_key: str | None = None
) -> dict[str, Any]:
    """One request at a time (the first two warm up and are not counted)."""
    latencies, codes = [], []
    async with _client(url, api_key, connections=1) as client:
        for i, body in enumerate(bodies):
            lat, code = await _post(client, body)
            if i >= 2:
                latencies.append(lat)
                codes.append(code)
    out = _summary(latencies, codes, sum(latencies))
    return {"single_request_p50_ms": out["latency_p50_ms"],
            "single_request_p99_ms": out["latency_p99_ms"], "errors": out["errors"]}  # fmt: skip


_ENGINE_TOTALS = (
    "flashrec_engine_iterations_total", "flashrec_engine_waves_admitted_total",
    "flashrec_engine_requests_admitted_total", "flashrec_engine_busy_seconds_total",
    "flashrec_request_latency_seconds_sum{endpoint=/v1/completions}",
    "flashrec_request_latency_seconds_count{endpoint=/v1/completions}",
    "flashrec_request_stage_seconds_sum{stage=queue}",
    "flashrec_request_stage_seconds_sum{stage=prefill}",
    "flashrec_request_stage_seconds_sum{stage=decode}",
    "flashrec_event_loop_lag_seconds_sum", "flashrec_event_loop_lag_seconds_count",
    "flashrec_event_loop_lag_seconds_bucket{le=0.01}",
)  # fmt: skip


def _engine_totals(url: str, api_key: str | None) -> dict[str, float]:
    from flashrec_core.testing.server_process import read_metrics

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    samples = read_metrics(url, headers)
    return {k: samples.get(k, 0.0) for k in _ENGINE_TOTALS}


def _engine_view(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """What the server did during a run: mean wave size, the engine thread's utilization and
    iteration time, and per request the server's own latency (first byte in to response out)
    split into queue, prefill and decode; the rest of the server's latency is HTTP, parsing and
    response building, the rest of the client's is the network and the client itself."""
    e, m, tail = "flashrec_engine_", "flashrec_request_", "_total"
    d = {k.removeprefix(e).removesuffix(tail): after[k] - before[k] for k in _ENGINE_TOTALS}
    waves, iters = max(d["waves_admitted"], 1), max(d["iterations"], 1)
    answered = max(d[f"{m}latency_seconds_count{{endpoint=/v1/completions}}"], 1)
    probes = max(d["flashrec_event_loop_lag_seconds_count"], 1)

    def per_request_ms(key: str) -> float:
        return 1e3 * d[key] / answered

    return {
        "waves": int(d["waves_admitted"]),
        "mean_requests_per_wave": d["requests_admitted"] / waves,
        "engine_busy_fraction": d["busy_seconds"] / seconds if seconds > 0 else 0.0,
        "mean_iteration_ms": 1e3 * d["busy_seconds"] / iters,
        "server_latency_mean_ms": per_request_ms(f"{m}latency_seconds_sum{{endpoint=/v1/completions}}"),
        **{f"{stage}_mean_ms": per_request_ms(f"{m}stage_seconds_sum{{stage={stage}}}")
           for stage in ("queue", "prefill", "decode")},
        "event_loop_lag_mean_ms": 1e3 * d["flashrec_event_loop_lag_seconds_sum"] / probes,
        "event_loop_lag_over_10ms": 1 - d["flashrec_event_loop_lag_seconds_bucket{le=0.01}"] / probes,
    }  # fmt: skip


def run_server_bench(
    url: str, prompts: Callable[[int], list[list[int]]], n: int, rates: Sequence[float],
    saturation_concurrency: int, api_key: str | None = None,
    floor: Callable[[list[list[int]]], float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Unloaded latency, saturation throughput, then each open-loop rate (a fraction of the
    saturation throughput when a rate is <= 1.5, else requests/s). `prompts(run)` gives each run
    fresh prompts (same shared prefix), so no run finds another's prompts in the prefix cache.
    `floor(prompts)`: the roofline floor in seconds of those prompts at this n (`server_floor`),
    which puts the saturation run's share of it in the result."""
    result: dict[str, Any] = {"path": "server", "n": n}
    result.update(asyncio.run(unloaded(url, completion_bodies(prompts(0)[:22], n), api_key)))
    before, start = _engine_totals(url, api_key), time.perf_counter()
    sat = asyncio.run(
        closed_loop(url, completion_bodies(prompts(1), n), saturation_concurrency, api_key)
    )
    sat["engine"] = _engine_view(before, _engine_totals(url, api_key), time.perf_counter() - start)
    if floor is not None:
        sent = prompts(1)
        sat["roofline_requests_per_s"] = len(sent) / floor(sent)
        sat["percent_of_roofline"] = 100 * sat["throughput_rps"] / sat["roofline_requests_per_s"]
    result["saturation"] = sat
    result["open_loop"] = []
    for i, rate in enumerate(rates):
        rps = rate * sat["throughput_rps"] if rate <= 1.5 else rate
        bodies = completion_bodies(prompts(2 + i), n)
        before, start = _engine_totals(url, api_key), time.perf_counter()
        run = asyncio.run(open_loop(url, bodies, rps, api_key, seed=i))
        run["engine"] = _engine_view(
            before, _engine_totals(url, api_key), time.perf_counter() - start
        )
        result["open_loop"].append({"fraction_of_saturation": rps / sat["throughput_rps"], **run})
    return result


def server_floor(
    url: str, api_key: str | None, model_dir: Path, n: int, level_sizes: tuple[int, ...]
) -> Callable[[list[list[int]]], float] | None:
    """The roofline floor of prompts at width n on the served model: its shape from the
    checkpoint's config.json, what it serves with (FP8, cascade, budgets) from the model card,
    the peaks measured on this machine's GPU (the server's, when the load runs beside it).
    None without a GPU here: there is no peak to measure."""
    import json

    import torch

    from flashrec_core.bench.roofline import ServedModel, floor_seconds, measure_peaks
    from flashrec_core.registry import Registry

    if not torch.cuda.is_available():
        return None
    hf = json.loads((model_dir / "config.json").read_text())
    cfg = Registry.discover().resolve(hf["architectures"][0]).parse_config(hf)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    card = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]
    served = ServedModel(**card["flashrec"]["roofline"])
    try:  # beside a server whose KV pool took most of the card: a 1 GiB copy, not 4
        peaks = measure_peaks(served.fp8, torch.device("cuda"), copy_gib=1)
    except torch.OutOfMemoryError:
        print("no GPU memory left beside the server to measure peaks: no roofline figures",
              file=sys.stderr)  # fmt: skip
        return None
    finally:
        torch.cuda.empty_cache()  # hand the buffers back before the load starts

    def floor(prompts: list[list[int]]) -> float:
        return floor_seconds(cfg, served, peaks, [(len(p), n) for p in prompts], level_sizes)

    return floor
