"""Load generator for a running `flashrec serve`: open-loop Poisson arrivals at given rates, a
closed-loop saturation run, and unloaded single-request latency.

Open loop: each request is sent at its arrival time whether or not earlier ones have finished
(as real traffic arrives), so queueing shows in the latency instead of slowing the sender down.
Requests go to /v1/completions with token-id prompts (the synthetic bench's prompts), so the
server tokenizes nothing; latencies are client wall-clock (HTTP, JSON and queueing included).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

if TYPE_CHECKING:  # torch-free at import: the load's client processes import this module
    from flashrec_core.bench.roofline import Peaks, ServedModel
    from flashrec_core.spec import ModelConfig


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The server's API key as a request header (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def completion_bodies(prompts: Sequence[Sequence[int]], n: int) -> list[dict[str, Any]]:
    return [{"prompt": list(p), "n": n, "max_tokens": 3} for p in prompts]


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int, float]:
    """Latency, status and the client's JSON parse time of one request; a connection refused or
    cut counts as status 0 (an error in the summary), so a server that dies mid-run is
    reported, not a crash. The latency includes the parse (a client reads the answer), which
    is also returned apart: with the standard library's parser it grows with n (164 KB at
    n=512) and belongs to the client's CPU, not the server's."""
    start = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.TransportError:
        return time.perf_counter() - start, 0, 0.0
    parse = 0.0
    if r.status_code == 200:
        received = time.perf_counter()
        r.json()
        parse = time.perf_counter() - received
    return time.perf_counter() - start, r.status_code, parse


def _refusal(url: str, body: dict[str, Any], api_key: str | None) -> str:
    """The status and error message the server gives `body` (its OpenAI-shaped error)."""
    headers = auth_headers(api_key)
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
    except httpx.TransportError as exc:
        return f"no answer ({type(exc).__name__}: {exc})"
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:300]
    return f"{r.status_code}: {message}"


def _client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = auth_headers(api_key)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits)


@dataclass(frozen=True)
class _Share:
    """One client process's part of a run: its bodies, and either how many it keeps in flight
    (closed loop) or when it sends each (open loop: seconds after the run's start)."""

    bodies: list[dict[str, Any]]
    concurrency: int | None = None
    arrivals: list[float] | None = None


@dataclass(frozen=True)
class _Sent:
    start: float  # time.monotonic(): one clock for every process of the machine
    end: float
    latencies: list[float]
    codes: list[int]
    parses: list[float]  # the client's JSON parse of each answer (0 for errors)


async def _send_share(url: str, api_key: str | None, share: _Share) -> _Sent:
    latencies: list[float] = []
    codes: list[int] = []
    parses: list[float] = []
    if share.arrivals is not None:  # open loop: each request at its arrival, answered or not
        async with _client(url, api_key, connections=len(share.bodies)) as client:
            start = time.monotonic()
            tasks = []
            for body, at in zip(share.bodies, share.arrivals, strict=True):
                delay = start + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_post(client, body)))
            for lat, code, parse in await asyncio.gather(*tasks):
                latencies.append(lat)
                codes.append(code)
                parses.append(parse)
            return _Sent(start, time.monotonic(), latencies, codes, parses)
    queue = list(share.bodies)
    assert share.concurrency is not None
    async with _client(url, api_key, connections=share.concurrency) as client:

        async def worker() -> None:
            while queue:
                lat, code, parse = await _post(client, queue.pop())
                latencies.append(lat)
                codes.append(code)
                parses.append(parse)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(share.concurrency)))
        return _Sent(start, time.monotonic(), latencies, codes, parses)


def _client_process(url: str, api_key: str | None, share: _Share, go: Any, out: Any) -> None:
    go.wait()  # every client process is up and imported: start together
    try:
        out.put(asyncio.run(_send_share(url, api_key, share)))
    except BaseException as exc:  # the parent waits for one answer per process: send the error
        out.put(f"{type(exc).__name__}: {exc}")
        raise


def client_processes(connections: int) -> int:
    """How many client processes carry `connections` concurrent requests: one per 32, at most
    half this machine's cores. One httpx client's CPU time per request grows with the requests
    it has in flight (14 ms at 400 against 2 ms at 16, measured), so a single client process
    caps a saturation run near 70 req/s whatever the server can do."""
    return max(1, min((os.cpu_count() or 2) // 2, -(-connections // 32)))


def _run_split(url: str, api_key: str | None, shares: list[_Share]) -> _Sent:
    """Run the shares at once, one client process each (in this process when there is one);
    their latencies and codes together, from the first start to the last end."""
    if len(shares) == 1:
        return asyncio.run(_send_share(url, api_key, shares[0]))
    ctx = mp.get_context("spawn")  # the parent may hold CUDA (the roofline's peaks): no fork
    go, out = ctx.Barrier(len(shares) + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(url, api_key, s, go, out), daemon=True)
             for s in shares]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        go.wait(timeout=120)
        parts = [out.get(timeout=3600) for _ in procs]
    except threading.BrokenBarrierError:
        codes = [proc.exitcode for proc in procs]
        raise RuntimeError(f"the load client processes did not start (exit codes {codes}; "
                           "their tracebacks are above)") from None  # fmt: skip
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise RuntimeError(f"a load client process failed: {failed[0]}")
    return _Sent(
        min(p.start for p in parts), max(p.end for p in parts),
        [x for p in parts for x in p.latencies], [c for p in parts for c in p.codes],
        [x for p in parts for x in p.parses],
    )  # fmt: skip


def _summary(sent: _Sent) -> dict[str, Any]:
    ok = [lat for lat, c in zip(sent.latencies, sent.codes) if c == 200]
    parses = [p for p, c in zip(sent.parses, sent.codes) if c == 200]
    seconds = sent.end - sent.start
    return {
        "sent": len(sent.codes),
        "seconds": seconds,
        "errors": sum(c != 200 for c in sent.codes),
        "throughput_rps": len(ok) / seconds if seconds > 0 else 0.0,
        "latency_p50_ms": 1e3 * float(np.percentile(ok, 50)) if ok else None,
        "latency_p99_ms": 1e3 * float(np.percentile(ok, 99)) if ok else None,
        "latency_max_ms": 1e3 * max(ok) if ok else None,
        "client_parse_mean_ms": 1e3 * float(np.mean(parses)) if parses else None,
    }


def open_loop(
    url: str, bodies: Sequence[dict[str, Any]], rate: float, api_key: str | None = None,
    seed: int = 0, processes: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Send `bodies` at Poisson arrivals of `rate` requests/s.

    The arrivals are a Poisson process conditioned on len(bodies) arrivals in len(bodies) /
    rate seconds (sorted uniform times in that window), so a run offers exactly `rate`: free
    exponential gaps end anywhere within about sqrt(len) gaps of it (1.4 s instead of 1.18 s
    for 96 arrivals at 81.5 req/s, measured), and the achieved rate would read that draw, not
    the server. One schedule is dealt round-robin to the client processes, so the run ends
    at its last arrival's answer, not at the latest of several independent streams."""
    k = max(1, min(processes or client_processes(len(bodies)), len(bodies)))
    window = len(bodies) / rate
    arrivals = np.sort(np.random.default_rng(seed).uniform(0.0, window, len(bodies))).tolist()
    shares = [_Share(list(bodies[i::k]), arrivals=arrivals[i::k]) for i in range(k)]
    out = _summary(_run_split(url, api_key, shares))
    return {"offered_rps": rate, "arrival_span_s": window, "client_processes": k, **out}


def closed_loop(
    url: str, bodies: Sequence[dict[str, Any]], concurrency: int, api_key: str | None = None,
    processes: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`concurrency` requests always in flight (split over client processes): the server's
    saturated throughput."""
    k = max(1, min(processes or client_processes(concurrency), concurrency, len(bodies)))
    shares = [
        _Share(list(bodies[i::k]), concurrency=len(range(i, concurrency, k))) for i in range(k)
    ]
    out = _summary(_run_split(url, api_key, shares))
    return {"concurrency": concurrency, "client_processes": k, **out}


def unloaded(
    url: str, bodies: Sequence[dict[str, Any]], api_key: str | None = None
) -> dict[str, Any]:
    """One request at a time."""
    sent = asyncio.run(_send_share(url, api_key, _Share(list(bodies), concurrency=1)))
    out = _summary(sent)
    return {"single_request_p50_ms": out["latency_p50_ms"],
            "single_request_p99_ms": out["latency_p99_ms"], "errors": out["errors"],
            "client_parse_mean_ms": out["client_parse_mean_ms"],
            "seconds": out["seconds"]}  # fmt: skip


_STAGES = ("intake", "queue", "prefill", "decode", "shaping")
"""The server's request stages (`flashrec_request_stage_seconds`), in a request's order."""
_ENGINE_TOTALS = (
    "flashrec_engine_iterations_total", "flashrec_engine_waves_admitted_total",
    "flashrec_engine_requests_admitted_total", "flashrec_engine_busy_seconds_total",
    "flashrec_engine_cpu_seconds_total", "flashrec_engine_results_wait_seconds_total",
    "process_cpu_seconds_total", "flashrec_engine_side_cpu_seconds_total",
    "flashrec_engine_own_process",
    "flashrec_request_latency_seconds_sum{endpoint=/v1/completions}",
    "flashrec_request_latency_seconds_count{endpoint=/v1/completions}",
    *(f"flashrec_request_stage_seconds_sum{{stage={stage}}}" for stage in _STAGES),
    "flashrec_event_loop_lag_seconds_sum", "flashrec_event_loop_lag_seconds_count",
    "flashrec_event_loop_lag_seconds_bucket{le=0.01}",
    "flashrec_engine_admission_retries_total{reason=kv_slots}",
    "flashrec_engine_admission_retries_total{reason=device_memory}",
    "flashrec_engine_beam_steps_total", "flashrec_engine_beam_forwards_total",
    "flashrec_engine_mixed_forwards_total",
    *(f"flashrec_gc_pause_seconds_{kind}{{generation={g}}}" for kind in ("sum", "count")
      for g in range(3)),
)  # fmt: skip


def _engine_totals(url: str, api_key: str | None) -> dict[str, float]:
    from flashrec_core.testing.server_process import read_metrics

    headers = auth_headers(api_key)
    samples = read_metrics(url, headers)
    return {k: samples.get(k, 0.0) for k in _ENGINE_TOTALS}


def _engine_view(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """What the server did during a run: mean wave size, the engine thread's utilization and
    iteration time, and per request the server's own latency (first byte in to response out)
    split into the HTTP side's intake (body, validation, tokenizing) and shaping (choices, JSON)
    around the engine's queue, prefill and decode. The rest of the server's latency, `handoff`,
    is getting the request to the engine and its result back to the route (with an engine
    process, the pipe both ways and the wake-ups of the threads that read it) and sending the
    response; the rest of the client's is the network and the client itself. A server from
    before the intake and shaping stages reports 0 for both, and they count in the handoff."""
    e, m, tail = "flashrec_engine_", "flashrec_request_", "_total"
    d = {k.removeprefix(e).removesuffix(tail): after[k] - before[k] for k in _ENGINE_TOTALS}
    waves, iters = max(d["waves_admitted"], 1), max(d["iterations"], 1)
    answered = max(d[f"{m}latency_seconds_count{{endpoint=/v1/completions}}"], 1)
    probes = max(d["flashrec_event_loop_lag_seconds_count"], 1)
    own = after["flashrec_engine_own_process"]  # a gauge: 1 with --engine-process

    def per_request_ms(key: str) -> float:
        return 1e3 * d[key] / answered

    server_ms = per_request_ms(f"{m}latency_seconds_sum{{endpoint=/v1/completions}}")
    stages_ms = {f"{stage}_mean_ms": per_request_ms(f"{m}stage_seconds_sum{{stage={stage}}}")
                 for stage in _STAGES}  # fmt: skip
    return {
        "waves": int(d["waves_admitted"]),
        "mean_requests_per_wave": d["requests_admitted"] / waves,
        "engine_busy_fraction": d["busy_seconds"] / seconds if seconds > 0 else 0.0,
        "mean_iteration_ms": 1e3 * d["busy_seconds"] / iters,
        # 1: every wave's beam step ran its own forward; lower with --merge-beam-steps
        "beam_forwards_per_step": d["beam_forwards"] / max(d["beam_steps"], 1),
        # admissions whose prefill carried a step group (--mixed-prefill-steps), an iteration
        "mixed_forwards_per_iteration": d["mixed_forwards"] / iters,
        "engine_cpu_ms_per_iteration": 1e3 * d["cpu_seconds"] / iters,
        # blocked on finished beams' copies: the GPU ahead of the host (0: the host the bound)
        "results_wait_ms_per_iteration": 1e3 * d["results_wait_seconds"] / iters,
        # the server's CPU time outside the engine thread: HTTP, parsing, answers (and, for a
        # model run on the CPU, torch's intra-op worker threads); with an engine process, both
        # processes' (the HTTP process's whole, the engine process's other threads)
        "other_cpu_ms_per_request": 1e3 * (d["process_cpu_seconds"] - d["cpu_seconds"]
                                           + own * d["side_cpu_seconds"]) / answered,
        # of that, the engine process's threads beside the engine thread (pipe, commands)
        "engine_process_other_cpu_ms_per_request":
            1e3 * own * (d["side_cpu_seconds"] - d["cpu_seconds"]) / answered,
        "own_process": bool(own),
        "server_latency_mean_ms": server_ms,
        **stages_ms,
        "handoff_mean_ms": server_ms - sum(stages_ms.values()),
        "event_loop_lag_mean_ms": 1e3 * d["flashrec_event_loop_lag_seconds_sum"] / probes,
        "event_loop_lag_over_10ms": 1 - d["flashrec_event_loop_lag_seconds_bucket{le=0.01}"] / probes,
        **{f"admission_retries_{why}": int(d[f"admission_retries_total{{reason={why}}}"])
           for why in ("kv_slots", "device_memory")},
        # the cyclic collector's pauses (GIL held) a second of the run, and the full ones' count
        "gc_pause_ms_per_s": 1e3 * sum(d[f"flashrec_gc_pause_seconds_sum{{generation={g}}}"]
                                       for g in range(3)) / max(seconds, 1e-9),
        "gc_full_collections": int(d["flashrec_gc_pause_seconds_count{generation=2}"]),
        "gc_full_pause_mean_ms": 1e3 * d["flashrec_gc_pause_seconds_sum{generation=2}"]
        / max(d["flashrec_gc_pause_seconds_count{generation=2}"], 1),
    }  # fmt: skip


STEADY_ROUNDS = 3
"""A closed loop measures saturation only when it sends at least this many times its
concurrency (session 24: 1,600 requests at 800 in flight gave 77% of offline throughput, mostly
the ramp-up and drain of about two rounds)."""


class ProfileWindow:
    """A torch.profiler window of the server (its /start_profile and /stop_profile, which
    `flashrec serve --torch-profile-dir` enables) opened `after_s` into a run for `seconds`,
    on a thread beside the load. `result()` is the server's answer to the stop, with the loop
    summary of its trace (bench/trace_summary.py) when the trace is on this machine."""

    def __init__(self, url: str, api_key: str | None, after_s: float, seconds: float) -> None:
        self._headers = auth_headers(api_key)
        self._url, self._after_s, self._seconds = url, after_s, seconds
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="profile-window", daemon=True)
        self._thread.start()

    def _post(self, route: str) -> dict[str, Any]:
        r = httpx.post(self._url + route, headers=self._headers, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(
                f"{route}: {r.status_code} {r.text[:300]} (does the server run with "
                "--torch-profile-dir?)"
            )
        return r.json()

    def _run(self) -> None:
        try:
            time.sleep(self._after_s)
            self._post("/start_profile")
            time.sleep(self._seconds)
            self._out = self._post("/stop_profile")
            trace = Path(self._out["trace"])
            if trace.is_file():
                from flashrec_core.bench.trace_summary import load_events, summarize

                self._out["loop"] = summarize(load_events(trace))
        except Exception as exc:  # reported in the result; the load run goes on
            self._out = {"error": f"{type(exc).__name__}: {exc}"}

    def result(self) -> dict[str, Any]:
        self._thread.join()
        return self._out


def run_server_bench(
    url: str, prompts: Callable[[int], list[list[int]]], n: int, rates: Sequence[float],
    saturation_concurrency: int, api_key: str | None = None,
    floor: ServerFloor | None = None, processes: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None, profile_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Unloaded latency, saturation throughput, then each open-loop rate (a fraction of the
    saturation throughput when a rate is <= 1.5, else requests/s). `prompts(run)` gives each run
    fresh prompts (same shared prefix), so no run finds another's prompts in the prefix cache.
    `floor(prompts)`: the roofline floor in seconds of those prompts at this n (`server_floor`),
    which puts the saturation run's share of it in the result. `progress(result)` after each
    phase: a run cut short keeps what it measured. `profile_s`: during each open-loop run, a
    profiler window that long from 40% into it (`ProfileWindow`; its answer in the run's
    "profile")."""
    report = progress or (lambda _: None)

    def viewed(run: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`run(url, *args, **kwargs)` with the server's view of it over the load's own window
        (client processes start before that window opens)."""
        before = _engine_totals(url, api_key)
        out = run(url, *args, **kwargs)
        out["engine"] = _engine_view(before, _engine_totals(url, api_key), out["seconds"])
        return out

    result: dict[str, Any] = {"path": "server", "n": n}
    singles = completion_bodies(prompts(0)[:22], n)
    unloaded(url, singles[:2], api_key)  # warm-up, not counted
    # where one request's time goes: the server's latency, its queue / prefill / decode
    single = viewed(unloaded, singles[2:], api_key)
    if single["single_request_p50_ms"] is None:  # nothing to measure: say why, not a bare None
        raise RuntimeError(
            f"the server refused every unloaded request; it answered one with "
            f"{_refusal(url, singles[2], api_key)} (do the bench's --prompt-len, --level-sizes "
            "and -n fit the served model and catalog?)"
        )
    del single["seconds"]
    result.update(single)
    report(result)
    sat = viewed(
        closed_loop, completion_bodies(prompts(1), n), saturation_concurrency, api_key, processes
    )
    # each client sends its first request at once and the last ones into an emptying server:
    # with fewer than 3 rounds of the concurrency the run is mostly that ramp-up and drain
    sat["steady_state"] = sat["sent"] >= STEADY_ROUNDS * saturation_concurrency
    if floor is not None:
        sent = prompts(1)
        sat["roofline_requests_per_s"] = len(sent) / floor(sent)
        sat["percent_of_roofline"] = 100 * sat["throughput_rps"] / sat["roofline_requests_per_s"]
        sat.update(floor.peaks.fields())
    result["saturation"] = sat
    result["open_loop"] = []
    report(result)
    for i, rate in enumerate(rates):
        rps = rate * sat["throughput_rps"] if rate <= 1.5 else rate
        bodies = completion_bodies(prompts(2 + i), n)
        window = (
            ProfileWindow(url, api_key, 0.4 * len(bodies) / rps, profile_s) if profile_s else None
        )
        run = viewed(open_loop, bodies, rps, api_key, seed=i, processes=processes)
        if window is not None:
            run["profile"] = window.result()
        result["open_loop"].append({"fraction_of_saturation": rps / sat["throughput_rps"], **run})
        report(result)
    return result


@dataclass(frozen=True)
class ServerFloor:
    """The roofline floor of prompts at width n on the served model (`server_floor`); called
    with prompts, their floor in seconds."""

    config: ModelConfig
    served: ServedModel
    peaks: Peaks
    n: int
    level_sizes: tuple[int, ...]

    def __call__(self, prompts: list[list[int]]) -> float:
        from flashrec_core.bench.roofline import floor_seconds

        shapes = [(len(p), self.n) for p in prompts]
        return floor_seconds(self.config, self.served, self.peaks, shapes, self.level_sizes)


def server_floor(
    url: str, api_key: str | None, model_dir: Path, n: int, level_sizes: tuple[int, ...]
) -> ServerFloor | None:
    """The roofline floor of prompts at width n on the served model: its shape from the
    checkpoint's config.json, what it serves with (FP8, cascade, budgets) from the model card,
    the peaks measured on this machine's GPU (the server's, when the load runs beside it).
    None without a GPU here: there is no peak to measure."""
    import json

    import torch

    from flashrec_core.bench.roofline import ServedModel, measure_peaks_beside
    from flashrec_core.registry import Registry

    if not torch.cuda.is_available():
        return None
    hf = json.loads((model_dir / "config.json").read_text())
    cfg = Registry.discover().resolve(hf["architectures"][0]).parse_config(hf)
    headers = auth_headers(api_key)
    card = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]
    served = ServedModel(**card["flashrec"]["roofline"])
    peaks = measure_peaks_beside(served.fp8, torch.device("cuda"), "server")
    if peaks is None:
        return None
    return ServerFloor(cfg, served, peaks, n, level_sizes)
