"""Why the server's engine thread does the same work slower than `Engine.generate`: the same
workload through the engine loop in four ways, without HTTP, to separate the causes.

1. `offline`: `Engine.generate` driving the loop on this thread (what `bench --engine` times);
2. `thread`: the loop on its own thread (as in `flashrec serve`), every request submitted at once
   from this thread, which then waits on the futures;
3. `closed C SCHEDULE`: the loop thread under a closed loop of C requests in flight (as
   `bench --server` loads the server): a request is submitted each time one finishes, so waves
   are as large as what has arrived when the loop admits; once per EngineConfig.schedule;
4. `thread + GIL d`: as 2, with a pure-Python thread holding the GIL a share `d` of the time in
   2 ms bursts (what the HTTP thread does while it parses requests and builds answers).

Each variant runs on fresh prompts (no prefix-cache hits across variants) and reports req/s
and the loop's own view: waves, requests per wave, busy seconds per iteration. Usage on the
GPU machine:

    python3 scripts/engine_thread_probe.py /tmp/bench-ckpt OUT_DIR [-n 50] [--requests 400]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import Any

import torch

from flashrec_core.bench.workload import RequestSpec, synthetic_requests
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.heap import frozen_heap
from flashrec_core.engine.requests import GenerationRequest


def _burn(duty: float, stop: threading.Event, burst_s: float = 0.002) -> None:
    """Hold the GIL `duty` of the time: pure-Python bursts of `burst_s`, then sleep."""
    rest = burst_s * (1 - duty) / duty
    while not stop.is_set():
        end = time.perf_counter() + burst_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        time.sleep(rest)


def _closed(engine: Engine, reqs: list[GenerationRequest], concurrency: int) -> None:
    pending = list(reversed(reqs))
    live = {engine.loop.submit(pending.pop(), bounded=False).future
            for _ in range(min(concurrency, len(pending)))}  # fmt: skip
    while live:
        done, live = wait(live, return_when=FIRST_COMPLETED)
        for f in done:
            f.result()
            if pending:
                live.add(engine.loop.submit(pending.pop(), bounded=False).future)


def _all_at_once(engine: Engine, reqs: list[GenerationRequest]) -> None:
    handles = [engine.loop.submit(r, bounded=False) for r in reqs]
    for h in handles:
        h.future.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--concurrency", default="400,800", help="closed-loop variants")
    ap.add_argument("--duty", default="0.15,0.3", help="GIL-holding shares of the burner")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    engine = Engine.from_config(
        EngineConfig(model_path=str(ckpt), show_progress=False),
        SearchConfig(catalog_path=str(ckpt / "catalog.json")),
    )
    seeds = iter(range(1, 1000))

    def fresh(count: int = args.requests) -> list[GenerationRequest]:
        return synthetic_requests(
            RequestSpec(count, args.prompt_len, 64, args.n),
            engine.layout,
            seed=0,
            body_seed=next(seeds),
        )

    for _ in range(2):  # warm-up: JIT, graph captures, allocator growth
        engine.generate(fresh())
    results: list[dict[str, Any]] = []

    def measure(name: str, run: Callable[[list[GenerationRequest]], None], count: int) -> None:
        reqs = fresh(count)
        before = engine.loop.stats()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(reqs)
        seconds = time.perf_counter() - start
        after = engine.loop.stats()
        waves = after.waves_admitted - before.waves_admitted
        iters = after.iterations - before.iterations
        busy = after.busy_seconds - before.busy_seconds
        row = {
            "variant": name, "n": args.n, "requests": count, "requests_per_s": count / seconds,
            "waves": waves, "requests_per_wave": count / max(waves, 1), "iterations": iters,
            "busy_ms_per_iteration": 1e3 * busy / max(iters, 1),
            "busy_ms_per_request": 1e3 * busy / count,
        }  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)

    with frozen_heap():
        measure("offline", engine.generate, args.requests)
        engine.loop.start()
        _all_at_once(engine, fresh())  # the new thread's first run (per-thread warm-up) uncounted
        measure("thread", lambda r: _all_at_once(engine, r), args.requests)
        for schedule in ("interleaved", "decode_first"):
            engine.loop.schedule = schedule
            for c in (int(x) for x in args.concurrency.split(",")):
                measure(f"closed {c} {schedule}", lambda r, c=c: _closed(engine, r, c),
                        3 * args.requests)  # fmt: skip
        engine.loop.schedule = "interleaved"
        for duty in (float(x) for x in args.duty.split(",")):
            stop = threading.Event()
            burner = threading.Thread(target=_burn, args=(duty, stop), daemon=True)
            burner.start()
            try:
                measure(f"thread + GIL {duty}", lambda r: _all_at_once(engine, r), args.requests)
            finally:
                stop.set()
                burner.join()
        engine.loop.stop()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"engine_thread_probe_n{args.n}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
