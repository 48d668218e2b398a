"""The server under concurrent load, client disconnects, a full queue and SIGTERM: answers stay
equal to the same request served alone, and every resource returns to idle."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from flashrec_core.testing.hf_beam import assert_same_ranking
from flashrec_core.testing.server_process import ServerProcess, alive, read_metrics

from .conftest import API_KEY, server_args
from .test_api import ATOL_SAME_ENGINE, assert_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WORDS = [f"w{i}" for i in range(48)]


def _body(prompt: str, n: int, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": prompt}], "n": n, **extra}


def _ranked(response: dict) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(c["flashrec"]["codes"]), c["flashrec"]["logprob"]) for c in response["choices"]]


async def _send_all(url: str, bodies: list[dict], concurrency: int) -> list[httpx.Response]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=120) as client:

        async def one(body: dict) -> httpx.Response:
            async with limit:
                return await client.post("/v1/chat/completions", json=body)

        return await asyncio.gather(*(one(b) for b in bodies))


def _assert_answers_as_alone(answers: list[httpx.Response], alone: list[dict]) -> None:
    """Every answer under load is a 200 that ranks like the same request served alone."""
    assert [r.status_code for r in answers] == [200] * len(answers), {
        r.status_code for r in answers
    }
    for r, ref in zip(answers, alone):
        assert_same_ranking(_ranked(r.json()), _ranked(ref), ATOL_SAME_ENGINE, ATOL_SAME_ENGINE)


def test_300_concurrent_requests_equal_the_same_requests_alone(server: ServerProcess) -> None:
    rng = random.Random(5)
    # 40 distinct requests (prompts share prefixes, so the prefix cache is exercised), mixed n
    distinct = [
        _body("user history " + " ".join(rng.choices(WORDS, k=rng.randint(2, 30))), n)
        for n in (1, 3, 8, 16, 33) for _ in range(8)
    ]  # fmt: skip
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        alone = [c.post("/v1/chat/completions", json=b).json() for b in distinct]
    picks = [rng.randrange(len(distinct)) for _ in range(300)]
    before = read_metrics(server.url)
    answers = asyncio.run(_send_all(server.url, [distinct[i] for i in picks], concurrency=32))
    _assert_answers_as_alone(answers, [alone[i] for i in picks])
    assert_idle(server)
    after = read_metrics(server.url)
    assert after["flashrec_invalid_results_total"] == 0
    hits = (
        after["flashrec_prefix_cache_hit_tokens_total"]
        - before["flashrec_prefix_cache_hit_tokens_total"]
    )
    assert hits > 0, "repeated prompts are served from the prefix cache"
    mixed = (
        after["flashrec_engine_mixed_forwards_total"]
        - before["flashrec_engine_mixed_forwards_total"]
    )
    assert mixed > 0, "on the CPU (eager), admitted prefills carry the steps of waves in flight"


def test_chunked_prefill_under_load_answers_as_alone(checkpoint: Path) -> None:
    """`--prefill-tokens-per-step`: waves admitted beside others prefill in 8-token pieces
    while those step; under concurrent load every answer equals the same request served alone
    and everything returns to idle."""
    rng = random.Random(11)
    distinct = [
        _body("user history " + " ".join(rng.choices(WORDS, k=rng.randint(12, 40))), n)
        for n in (2, 8, 24) for _ in range(5)
    ]  # fmt: skip
    # waves of at most 48 beam rows, so a burst of 16 is several waves, admitted beside others
    args = server_args(checkpoint, "--prefill-chunk-tokens", "8", "--prefill-tokens-per-step", "8",
                       "--max-wave-rows", "48")  # fmt: skip
    with ServerProcess(args) as server:
        # the load first, so its prompts are not in the prefix cache yet and prefill in pieces
        picks = [rng.randrange(len(distinct)) for _ in range(60)]
        answers = asyncio.run(_send_all(server.url, [distinct[i] for i in picks], concurrency=16))
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
            alone = [c.post("/v1/chat/completions", json=b).json() for b in distinct]
        _assert_answers_as_alone(answers, [alone[i] for i in picks])
        assert_idle(server)
        metrics = read_metrics(server.url)
        assert metrics["flashrec_invalid_results_total"] == 0
        assert metrics["flashrec_engine_prefill_pieces_total"] > 0, "no prefill ran in pieces"


@pytest.fixture
def busy_server(checkpoint: Path):
    """A server whose waves hold 64 beam rows, so a burst of n=32 requests queues for a while."""
    with ServerProcess(server_args(checkpoint, "--max-wave-rows", "64", "--max-queue", "400",
                                   "--shutdown-grace", "60")) as proc:  # fmt: skip
        yield proc


def _burst(count: int, n: int = 32) -> list[dict]:
    return [
        _body(f"user history w{i % 40} w{(i * 7) % 40} " + "w1 " * 200, n) for i in range(count)
    ]


def test_client_that_disconnects_is_cancelled_and_freed(busy_server: ServerProcess) -> None:
    async def scenario() -> tuple[list[httpx.Response], bool]:
        load = asyncio.create_task(_send_all(busy_server.url, _burst(150), concurrency=150))
        await asyncio.sleep(0.5)  # the burst is queued now
        gone = False
        async with httpx.AsyncClient(base_url=busy_server.url, headers=HEADERS) as c:
            try:
                await c.post("/v1/chat/completions", json=_burst(1)[0], timeout=0.3)
            except httpx.TimeoutException:
                gone = True
        return await load, gone

    before = read_metrics(busy_server.url)
    answers, gone = asyncio.run(scenario())
    assert gone, "the request was meant to be still waiting when its client went away"
    assert all(r.status_code == 200 for r in answers)
    key = "flashrec_requests_total{endpoint=/v1/chat/completions,status=499}"
    assert read_metrics(busy_server.url).get(key, 0) - before.get(key, 0) == 1
    assert_idle(busy_server)


def test_full_queue_answers_503_with_retry_after(checkpoint: Path) -> None:
    args = server_args(checkpoint, "--max-wave-rows", "32", "--max-queue", "4")
    with ServerProcess(args) as proc:
        answers = asyncio.run(_send_all(proc.url, _burst(60), concurrency=60))
        codes = [r.status_code for r in answers]
        assert set(codes) == {200, 503} and codes.count(200) >= 4, codes
        full = next(r for r in answers if r.status_code == 503)
        assert full.headers["retry-after"] and full.json()["error"]["code"] == "queue_full"
        assert_idle(proc)
        again = httpx.post(
            proc.url + "/v1/chat/completions", json=_body("w1 w2", 4), headers=HEADERS
        )
        assert again.status_code == 200


def test_sigterm_drains_requests_in_flight_then_exits_0(busy_server: ServerProcess) -> None:
    async def scenario() -> tuple[list[httpx.Response], Exception | int]:
        load = asyncio.create_task(_send_all(busy_server.url, _burst(60), concurrency=60))
        await asyncio.sleep(0.5)
        busy_server.terminate()
        await asyncio.sleep(0.3)
        try:  # a new request after SIGTERM is refused
            async with httpx.AsyncClient(base_url=busy_server.url, headers=HEADERS) as c:
                late: Exception | int = (
                    await c.post("/v1/chat/completions", json=_body("w1", 2), timeout=10)
                ).status_code
        except httpx.HTTPError as exc:
            late = exc
        return await load, late

    start = time.monotonic()
    children = busy_server.children()  # the engine process (unless --no-engine-process)
    engine = busy_server.find_engine_pid()
    answers, late = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * 60, "requests in flight complete"
    assert isinstance(late, httpx.ConnectError) or late == 503, late
    assert busy_server.wait(timeout_s=60) == 0, busy_server.log()[-3000:]
    assert time.monotonic() - start < 60
    assert engine is None or not alive(engine), "the engine process outlived the server"
    # multiprocessing's resource tracker (a child too, with spawn) exits when it reads the end of
    # its pipe, just after the server: every other child gets a few seconds to end
    deadline = time.monotonic() + 5
    while (left := [pid for pid in children if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, "a child process outlived the server"


def test_a_second_sigterm_while_draining_still_exits_0(checkpoint: Path) -> None:
    """uvicorn replays each stop signal it caught once it has drained: the first ends the
    command with exit 0 and one log line, the second (an impatient supervisor, a double
    Ctrl-C) neither kills the process nor logs again."""
    with ServerProcess(server_args(checkpoint)) as proc:
        proc.terminate()
        time.sleep(0.05)
        assert proc.proc is not None and proc.proc.poll() is None, "still draining"
        proc.terminate()
        assert proc.wait(timeout_s=60) == 0, proc.log()[-3000:]
        assert proc.log().count("after draining") == 1, proc.log()[-3000:]


def test_profile_engine_writes_the_engine_threads_profile(checkpoint: Path, tmp_path: Path) -> None:
    profile = tmp_path / "engine.prof.txt"
    with ServerProcess(server_args(checkpoint, "--profile-engine", str(profile))) as proc:
        r = httpx.post(proc.url + "/v1/chat/completions", json=_body("w1 w2", 4), headers=HEADERS)
        assert r.status_code == 200
        m = read_metrics(proc.url)
        assert m["flashrec_engine_waves_admitted_total"] >= 1
        assert (
            m["flashrec_engine_requests_admitted_total"]
            >= m["flashrec_engine_waves_admitted_total"]
        )
        assert m["flashrec_engine_busy_seconds_total"] > 0
        # the engine thread's CPU is part of the process's, and no more than its busy time
        # (thread_time ticks in 1 ns steps; 1 ms of slack for the two clocks' granularity)
        cpu = m["flashrec_engine_cpu_seconds_total"]
        assert 0 < cpu <= m["flashrec_engine_busy_seconds_total"] + 1e-3
        assert cpu <= m["process_cpu_seconds_total"] + 1e-2  # /proc reports in 10 ms ticks
        wait = m["flashrec_engine_results_wait_seconds_total"]  # part of the busy time
        assert 0 <= wait <= m["flashrec_engine_busy_seconds_total"]
    text = profile.read_text()  # written when the engine thread ends, at shutdown
    assert "run_once" in text and "Ordered by: cumulative time" in text


def test_load_generator_splits_over_client_processes(server: ServerProcess) -> None:
    """`flashrec bench --server`'s closed and open loops, each over two client processes:
    every body is sent once and answered, and the window covers both processes."""
    from flashrec_core.bench.load import closed_loop, open_loop

    bodies = [{"prompt": f"user history w{i} w{i + 1}", "n": 4, "max_tokens": 3} for i in range(12)]
    answered = "flashrec_requests_total{endpoint=/v1/completions,status=200}"
    before = read_metrics(server.url).get(answered, 0.0)
    sat = closed_loop(server.url, bodies, concurrency=4, api_key=API_KEY, processes=2)
    assert (sat["client_processes"], sat["sent"], sat["errors"]) == (2, 12, 0), sat
    rate = open_loop(server.url, bodies, rate=50.0, api_key=API_KEY, processes=2)
    assert (rate["client_processes"], rate["sent"], rate["errors"]) == (2, 12, 0), rate
    assert read_metrics(server.url)[answered] - before == 24  # each body answered once per run
    # one schedule of 12 arrivals in 12 / 50 s over both processes: the run ends with its last
    # arrival's answer (0.25 s of slack: the processes leave their start barrier separately,
    # which a loaded 2-core CI machine may delay by tens of ms, and the event loop's timers)
    assert rate["arrival_span_s"] == pytest.approx(12 / 50.0)
    assert rate["seconds"] <= rate["arrival_span_s"] + rate["latency_max_ms"] / 1e3 + 0.25, rate
    for run in (sat, rate):
        assert run["throughput_rps"] == pytest.approx(12 / run["seconds"])
        assert 0 < run["latency_p50_ms"] <= run["latency_p99_ms"] <= 1e3 * run["seconds"]
        # the client's parse of each answer is inside its latency
        assert 0 < run["client_parse_mean_ms"] < run["latency_max_ms"], run


def test_bench_server_command_reports_each_phase(
    server: ServerProcess, checkpoint: Path, tmp_path: Path
) -> None:
    """`flashrec bench --server` end to end: unloaded, closed loop, one open-loop rate; each
    phase is reported (stderr and --out) as it ends, so a run cut short keeps what it measured."""
    import json
    import subprocess
    import sys

    out = tmp_path / "server_bench.json"
    cmd = [
        sys.executable, "-m", "flashrec_core.cli", "bench", "--server", server.url,
        "--model-dir", str(checkpoint), "--api-key", API_KEY, "-n", "4", "--requests", "6",
        "--prompt-len", "24", "--shared-prefix", "8", "--level-sizes", "32,32,32",
        "--concurrency", "3", "--rates", "0.5", "--client-processes", "2", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [line for line in proc.stderr.splitlines() if line.startswith("n=4 ")]
    assert [p.split(" (")[0].split(":")[0] for p in phases[:2]] == [
        "n=4 unloaded", "n=4 closed loop, 3 in flight"
    ] and len(phases) == 3 and phases[2].startswith("n=4 open loop "), phases  # fmt: skip
    assert "(6 arrivals over " in phases[2]
    # 6 requests are 2 rounds of 3 in flight: mostly ramp-up and drain, and said so
    assert "(NOT a steady state: 6 requests, under 3x the concurrency)" in phases[1]
    assert "; the client's JSON parse " in phases[0]
    result = json.loads(out.read_text())
    assert 0 < result["client_parse_mean_ms"] < result["single_request_p50_ms"]
    # the unloaded requests' server latency: five stages and the handoff between them
    alone = result["engine"]
    stages = [alone[f"{s}_mean_ms"] for s in ("intake", "queue", "prefill", "decode", "shaping")]
    assert all(ms > 0 for ms in stages) and alone["handoff_mean_ms"] > 0, alone
    assert alone["handoff_mean_ms"] == pytest.approx(alone["server_latency_mean_ms"] - sum(stages))
    assert ", shaping " in phases[0] and ", handoff " in phases[0]
    assert result["saturation"]["steady_state"] is False
    assert result["saturation"]["sent"] == 6 and result["saturation"]["errors"] == 0
    assert result["saturation"]["client_processes"] == 2
    # this server steps each wave alone (no --merge-beam-steps): one forward per beam step
    assert result["saturation"]["engine"]["beam_forwards_per_step"] == 1.0
    [run] = result["open_loop"]
    assert run["sent"] == 6 and run["errors"] == 0
    assert run["fraction_of_saturation"] == pytest.approx(0.5)


def test_load_generator_counts_a_dead_server_as_errors() -> None:
    """Nothing listens: every request is an error in the summary, and the run ends (no client
    process crashes and leaves the parent waiting)."""
    from flashrec_core.bench.load import closed_loop, open_loop
    from flashrec_core.testing.server_process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    bodies = [{"prompt": "w1", "n": 1, "max_tokens": 3}] * 6
    for run in (closed_loop(url, bodies, concurrency=4, processes=2),
                open_loop(url, bodies, rate=100.0, processes=2)):  # fmt: skip
        assert (run["sent"], run["errors"], run["throughput_rps"]) == (6, 6, 0.0), run
        assert run["latency_p50_ms"] is None


def test_bench_server_names_why_the_server_refused_its_requests(
    server: ServerProcess, checkpoint: Path
) -> None:
    """Prompts longer than the served model takes: the bench stops at its first phase with the
    server's own error message (it used to crash formatting a missing latency)."""
    from flashrec_core.bench.load import run_server_bench

    def prompts(run: int) -> list[list[int]]:
        return [[5] * 100_000 for _ in range(4)]

    with pytest.raises(RuntimeError, match=r"refused every unloaded request.*400: the prompt has"):
        run_server_bench(server.url, prompts, 4, [], 2, api_key=API_KEY)


def test_torch_profile_window_records_the_loop_phases(checkpoint: Path, tmp_path: Path) -> None:
    """/start_profile and /stop_profile (--torch-profile-dir): a window over the engine thread
    written as a Chrome trace with the loop's phase ranges, its misuse answered with 409 and
    the server serving on; a window still open at shutdown is written too."""
    import gzip
    import json
    import subprocess
    import sys

    traces = tmp_path / "traces"
    with ServerProcess(server_args(checkpoint, "--torch-profile-dir", str(traces))) as proc:
        url = proc.url
        assert httpx.post(url + "/start_profile").status_code == 401  # behind the API key
        stopped = httpx.post(url + "/stop_profile", headers=HEADERS)
        assert stopped.status_code == 409 and "no profile is running" in stopped.text
        assert httpx.post(url + "/start_profile", headers=HEADERS).json() == {
            "status": "profiling", "trace": None, "summary": None,
        }  # fmt: skip
        again = httpx.post(url + "/start_profile", headers=HEADERS)
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "profile_state"
        r = httpx.post(url + "/v1/chat/completions", json=_body("w1 w2", 4), headers=HEADERS)
        assert r.status_code == 200
        done = httpx.post(url + "/stop_profile", headers=HEADERS).json()
        assert done["status"] == "stopped"
        trace, summary = Path(done["trace"]), Path(done["summary"])
        assert trace.parent == traces and trace.name.endswith(".trace.json.gz")
        names = {
            e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        }
        phases = {"iteration", "retire", "step", "admit", "results"}
        assert {f"flashrec.{p}" for p in phases} <= names, sorted(
            n for n in names if "flashrec" in str(n)
        )
        assert "Self CPU" in summary.read_text()
        from flashrec_core.bench.trace_summary import load_events, summarize

        loop = summarize(load_events(trace))  # the real trace format, no GPU here
        assert loop["iterations"] >= 1 and {"step", "admit"} <= set(loop["phases"])
        r = httpx.post(url + "/v1/chat/completions", json=_body("w3 w4", 4), headers=HEADERS)
        assert r.status_code == 200  # serving on after the window
        # `flashrec bench --server --profile-seconds`: a window from 40% into the open-loop
        # run (8 requests at 20/s), long enough to hold some of it on a slow machine too
        out = tmp_path / "bench.json"
        cmd = [
            sys.executable, "-m", "flashrec_core.cli", "bench", "--server", url, "--model-dir",
            str(checkpoint), "--api-key", API_KEY, "-n", "4", "--requests", "8", "--prompt-len",
            "24", "--shared-prefix", "8", "--level-sizes", "32,32,32", "--concurrency", "2",
            "--rates", "20", "--profile-seconds", "3", "--out", str(out),
        ]  # fmt: skip
        bench = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-3000:]
        bench_result = json.loads(out.read_text())
        assert bench_result["saturation"]["steady_state"] is True  # 8 requests, 2 in flight
        [run] = bench_result["open_loop"]
        assert run["profile"]["status"] == "stopped", run["profile"]
        assert run["profile"]["loop"]["iterations"] >= 1
        assert "profile window: " + run["profile"]["trace"] in bench.stderr
        assert httpx.post(url + "/start_profile", headers=HEADERS).status_code == 200
    # the bench's window and the last one, open at shutdown, were written too
    assert len(list(traces.glob("*.trace.json.gz"))) == 3, proc.log()[-2000:]


def test_profile_routes_are_absent_without_a_profile_dir(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/start_profile", headers=HEADERS)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
