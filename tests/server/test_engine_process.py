"""The server's two modes: the engine in a process of its own (the default, `--engine-process`)
and in the server's process (`--no-engine-process`).

The suite's other files run the default. Here the one-process mode runs their scenarios again
(load, disconnects, timeouts, SIGTERM, catalogs, schemathesis), and its answers must equal the
default's on the same checkpoint (same weights, same search: the same ranking and log-probs to
the same-engine tolerance). Then what only the engine process has: a load error in it, its
death, and the benchmark's arithmetic over two processes."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flashrec_core.testing.hf_beam import assert_same_ranking
from flashrec_core.testing.server_process import (
    ServerProcess,
    alive,
    pids_with_env,
    read_metrics,
)

from . import test_api, test_catalogs, test_load, test_openapi_contract
from .conftest import API_KEY, server_args
from .test_api import ATOL_SAME_ENGINE, assert_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def one_process_args(checkpoint: Path, *extra: str) -> list[str]:
    return server_args(checkpoint, "--no-engine-process", *extra)


@pytest.fixture(scope="module")
def one_process(checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess(one_process_args(checkpoint)) as proc:
        yield proc


@pytest.fixture(scope="module")
def one_process_for_schemathesis(checkpoint: Path) -> Iterator[ServerProcess]:
    """Generated catalog uploads may replace the default catalog: a server of its own."""
    with ServerProcess(one_process_args(checkpoint)) as proc:
        yield proc


@pytest.mark.parametrize("label", test_openapi_contract.OPERATIONS + test_openapi_contract.MUTATING)
def test_every_operation_honours_its_schema_in_one_process(
    one_process_for_schemathesis: ServerProcess, label: str
) -> None:
    """schemathesis, as for the default mode: no 5xx and no schema violation, the catalog
    routes (the engine's own catalogs here, not commands) included."""
    test_openapi_contract._check(one_process_for_schemathesis, label)


def test_answers_equal_across_the_modes(server: ServerProcess, one_process: ServerProcess) -> None:
    bodies = [
        {"messages": [{"role": "user", "content": f"user history w{i} w{i + 3} w7"}], "n": n}
        for i, n in enumerate((1, 4, 16, 33))
    ]
    bodies.append({"prompt": [5, 9, 11, 200, 31], "n": 6})
    bodies.append({"messages": [{"role": "user", "content": "w1 w2"}], "n": 8,
                   "exclude_items": ["item-000386", "item-000089"]})  # fmt: skip
    for body in bodies:
        route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        a = httpx.post(server.url + route, json=body, headers=HEADERS, timeout=60)
        b = httpx.post(one_process.url + route, json=body, headers=HEADERS, timeout=60)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        ranked_a, ranked_b = test_load._ranked(a.json()), test_load._ranked(b.json())
        assert_same_ranking(ranked_a, ranked_b, ATOL_SAME_ENGINE, ATOL_SAME_ENGINE)
        items = [c["flashrec"]["items"] for c in a.json()["choices"]]
        assert items == [c["flashrec"]["items"] for c in b.json()["choices"]]
        # cached_tokens depends on what each server's prefix cache served before: not compared
        usage_a, usage_b = a.json()["usage"], b.json()["usage"]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage_a[key] == usage_b[key], key


def test_300_concurrent_requests_in_one_process(one_process: ServerProcess) -> None:
    test_load.test_300_concurrent_requests_equal_the_same_requests_alone(one_process)


def test_bad_input_is_refused_in_one_process(one_process: ServerProcess) -> None:
    """What `EngineLoop.check` refuses in this mode (the pipe's `EngineClient.check` in the
    default one): a width over the budget, a prompt over the context, an unknown catalog."""
    c = httpx.Client(base_url=one_process.url, headers=HEADERS, timeout=30)
    too_wide = c.post("/v1/chat/completions", json=test_load._body("w1", 10**6))
    assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
    long = c.post("/v1/completions", json={"prompt": [5] * 70_000, "n": 2})
    assert long.status_code == 400, long.text
    assert long.json()["error"]["code"] == "context_length_exceeded"
    unknown = c.post("/v1/chat/completions", json={**test_load._body("w1", 2), "catalog": "no"})
    assert unknown.status_code == 404
    assert c.post("/v1/chat/completions", json=test_load._body("w1 w2", 3)).status_code == 200


def test_models_health_ready_metrics_in_one_process(one_process: ServerProcess) -> None:
    test_api.test_models_health_ready_metrics(one_process, HEADERS)
    metrics = read_metrics(one_process.url)
    assert metrics["flashrec_engine_own_process"] == 0
    with pytest.raises(AssertionError, match="no engine process"):
        one_process.engine_pid()


def test_request_stages_split_the_server_latency_in_one_process(
    one_process: ServerProcess,
) -> None:
    test_api.test_request_stages_split_the_server_latency(one_process, HEADERS)


def test_the_default_runs_the_engine_in_a_process_of_its_own(server: ServerProcess) -> None:
    assert read_metrics(server.url)["flashrec_engine_own_process"] == 1
    assert server.engine_pid() in server.children()
    card = httpx.get(server.url + "/v1/models", headers=HEADERS).json()["data"][0]["flashrec"]
    assert card["architectures"] == ["Qwen3ForCausalLM"]  # the engine process's facts


def test_timeout_gives_504_and_frees_everything_in_one_process(one_process: ServerProcess) -> None:
    test_api.test_timeout_gives_504_and_frees_everything(one_process, HEADERS)


def test_disconnect_and_sigterm_in_one_process(checkpoint: Path) -> None:
    busy = ("--max-wave-rows", "64", "--max-queue", "400", "--shutdown-grace", "60")
    with ServerProcess(one_process_args(checkpoint, *busy)) as proc:
        test_load.test_client_that_disconnects_is_cancelled_and_freed(proc)
        test_load.test_sigterm_drains_requests_in_flight_then_exits_0(proc)


def test_full_queue_answers_503_in_one_process(checkpoint: Path) -> None:
    """The queue is the engine's in both modes: here its refusal is raised by `submit`, in the
    default mode it crosses the pipe as the request's error (test_load)."""
    args = one_process_args(checkpoint, "--max-wave-rows", "32", "--max-queue", "4")
    with ServerProcess(args) as proc:
        answers = test_load.asyncio.run(
            test_load._send_all(proc.url, test_load._burst(60), concurrency=60)
        )
        codes = [r.status_code for r in answers]
        assert set(codes) == {200, 503} and codes.count(200) >= 4, codes
        full = next(r for r in answers if r.status_code == 503)
        assert full.headers["retry-after"] and full.json()["error"]["code"] == "queue_full"
        assert_idle(proc)


def test_catalogs_load_swap_and_delete_in_one_process(checkpoint: Path, tmp_path: Path) -> None:
    a, a_items = test_catalogs._variant(checkpoint, tmp_path, "a", 1)
    b, b_items = test_catalogs._variant(checkpoint, tmp_path, "b", 2)
    with ServerProcess(one_process_args(checkpoint, "--catalog", f"shop={a}")) as proc:
        fixture = (proc, {"a": (a, a_items), "b": (b, b_items)})
        test_catalogs.test_named_catalogs_are_listed_and_picked_per_request(fixture)
        test_catalogs.test_swaps_under_load_every_answer_valid_under_its_version(fixture)
        # ends by deleting `shop`: then the default catalog is served alone
        test_catalogs.test_bad_catalog_is_refused_and_the_old_one_keeps_serving(fixture, tmp_path)
        listed = httpx.get(proc.url + "/v1/catalogs", headers=HEADERS).json()
        assert [x["name"] for x in listed["data"]] == ["default"]


def test_a_load_error_in_the_engine_process_fails_the_command(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The HTTP process reads the config, tokenizer and catalog; only the engine process reads
    the weights: a broken weights file must still fail `flashrec serve` with exit code 2 and
    the loader's message, before the port opens."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    [weights] = broken.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    proc = ServerProcess(server_args(broken))
    with pytest.raises(RuntimeError, match="exited with 2") as failed:
        proc.start()
    assert weights.name in str(failed.value), str(failed.value)[-2000:]


def test_ctrl_c_during_start_ends_both_processes(checkpoint: Path) -> None:
    """The engine process starts first and loads while the HTTP process loads its front. Ctrl-C
    (to the HTTP process alone here) then must end both: the engine process ignores SIGINT and
    SIGTERM (the HTTP process drains it), so the HTTP process must kill it; left to
    multiprocessing's exit clean-up, which only sends SIGTERM, the server would hang. Ctrl-C
    comes once the engine process ignores both signals, which it does before it loads."""
    marker = f"FLASHREC_TEST_MARKER=flashrec-test-{uuid.uuid4().hex}"
    name, value = marker.split("=")
    proc = ServerProcess(server_args(checkpoint), env={name: value})
    proc.launch()
    assert proc.proc is not None
    engine = _wait_for(proc.find_engine_pid)
    # then it loads the checkpoint (seconds), while the HTTP process waits for it
    _wait_for(lambda: _ignores(engine, signal.SIGTERM) and _ignores(engine, signal.SIGINT))
    proc.proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout_s=60) != 0, proc.log()[-2000:]
    finally:
        proc.stop()
    assert "KeyboardInterrupt" in proc.log(), proc.log()[-2000:]
    # multiprocessing's resource tracker (the HTTP process's child, with the same environment)
    # exits on its own a moment after the HTTP process; a left engine process never would
    end = time.monotonic() + 10
    while (left := pids_with_env(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, f"processes were left: {[_cmdline(pid) for pid in left]}"


def _wait_for(probe: Any, timeout_s: float = 60.0) -> Any:
    end = time.monotonic() + timeout_s
    while not (found := probe()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)
    return found


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]


def _ignores(pid: int, signum: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
    return bool(ignored & (1 << (signum - 1)))


def test_a_dead_engine_process_fails_requests_with_503_not_500(checkpoint: Path) -> None:
    with ServerProcess(server_args(checkpoint)) as proc:
        os.kill(proc.engine_pid(), signal.SIGKILL)
        end = time.monotonic() + 30
        while httpx.get(proc.url + "/health").status_code != 503:
            assert time.monotonic() < end, "the server did not notice its engine exited"
            time.sleep(0.1)
        assert httpx.get(proc.url + "/ready").status_code == 503
        r = httpx.post(
            proc.url + "/v1/chat/completions", json=test_load._body("w1", 2), headers=HEADERS
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        listing = httpx.get(proc.url + "/v1/catalogs", headers=HEADERS)  # a command: no reply
        assert listing.status_code == 503 and listing.json()["error"]["code"] == "engine_dead"
        assert read_metrics(proc.url) is not None  # /metrics still answers (no engine gauges)


def test_a_killed_server_leaves_no_engine_process_behind(checkpoint: Path) -> None:
    """SIGKILL gives the server no chance to stop its engine (a supervisor's last resort, the
    OOM killer): the engine process must notice the pipe's end and exit by itself, freeing the
    device, instead of living on as an orphan."""
    with ServerProcess(server_args(checkpoint)) as proc:
        engine = proc.engine_pid()
        assert proc.proc is not None
        proc.proc.kill()
        proc.proc.wait(timeout=10)
        # it drains for at most 5 s (nothing is in flight here), then exits
        end = time.monotonic() + 30
        while alive(engine):
            assert time.monotonic() < end, "the engine process outlived its server by 30 s"
            time.sleep(0.1)


def test_bench_counts_both_processes_cpu_outside_the_engine_thread() -> None:
    """`bench --server`'s engine view: in one process the HTTP side's CPU is the process's less
    the engine thread's; with an engine process it is the HTTP process's whole CPU plus the
    engine process's less its engine thread's."""
    from flashrec_core.bench.load import _ENGINE_TOTALS, _engine_view

    before = dict.fromkeys(_ENGINE_TOTALS, 0.0)
    after = {**before, "flashrec_request_latency_seconds_count{endpoint=/v1/completions}": 100.0,
             "process_cpu_seconds_total": 3.0, "flashrec_engine_cpu_seconds_total": 2.0,
             "flashrec_engine_side_cpu_seconds_total": 2.5}  # fmt: skip
    one = _engine_view(before, {**after, "flashrec_engine_own_process": 0.0}, 1.0)
    assert one["other_cpu_ms_per_request"] == pytest.approx(10.0)  # (3 - 2) s / 100
    assert one["engine_process_other_cpu_ms_per_request"] == 0 and not one["own_process"]
    two = _engine_view(before, {**after, "flashrec_engine_own_process": 1.0}, 1.0)
    assert two["other_cpu_ms_per_request"] == pytest.approx(35.0)  # (3 + 2.5 - 2) s / 100
    assert two["engine_process_other_cpu_ms_per_request"] == pytest.approx(5.0)
    assert two["own_process"]
