"""The HTTP API through real clients (the `openai` package and httpx) against a live server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, OpenAI

from flashrec_core.engine.engine import Engine
from flashrec_core.testing.hf_beam import assert_same_ranking
from flashrec_core.testing.server_process import ServerProcess, read_metrics

from .conftest import API_KEY, server_args

ATOL_SAME_ENGINE = 1e-5
"""Server vs in-process engine, both fp32 on CPU over the same files: only the batch a request
shares its steps with differs (GEMM blocking), measured under 2e-6 on a 3-level log-prob."""

PROMPT = "user history w1 w7 w3 item w9"


def client(server: ServerProcess, key: str = API_KEY) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def model_name(server: ServerProcess) -> str:
    return client(server).models.list().data[0].id


def ranked(choices: list) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(c["codes"]), c["logprob"]) for c in choices]


def test_chat_completion_with_the_openai_client(server: ServerProcess, engine: Engine) -> None:
    resp = client(server).chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": PROMPT}], n=8
    )
    assert resp.object == "chat.completion" and len(resp.choices) == 8
    ext = [c.model_extra["flashrec"] for c in resp.choices]
    assert [c.index for c in resp.choices] == list(range(8))
    assert [e["rank"] for e in ext] == list(range(8))
    scores = [e["logprob"] for e in ext]
    assert scores == sorted(scores, reverse=True), "choices are ranked best first"
    for choice, e in zip(resp.choices, ext):
        assert choice.message.content == engine.layout.format(e["codes"])
        assert e["items"] and engine.catalog.lookup(e["codes"]) == tuple(e["items"])
        assert math.isclose(sum(e["level_logprobs"]), e["logprob"], abs_tol=1e-5)
        assert math.isclose(e["score"], e["logprob"] / 3, rel_tol=1e-9)
    req = engine.make_request(messages=[{"role": "user", "content": PROMPT}], n=8)
    [alone] = engine.generate([req])
    got = ranked(ext)
    assert_same_ranking(got, [(c.codes, c.logprob) for c in alone.choices], ATOL_SAME_ENGINE)
    assert resp.usage.prompt_tokens == len(req.prompt_ids)
    assert resp.usage.completion_tokens == 8 * 3
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_text_parts_and_system_messages(server: ServerProcess) -> None:
    resp = client(server).chat.completions.create(
        model=model_name(server), n=3,
        messages=[{"role": "system", "content": "recommend"},
                  {"role": "user", "content": [{"type": "text", "text": "w1 w2"},
                                               {"type": "text", "text": " w3"}]}],
    )  # fmt: skip
    assert len(resp.choices) == 3


def test_completions_text_token_ids_and_batches(server: ServerProcess, engine: Engine) -> None:
    c = client(server)
    text = c.completions.create(model=model_name(server), prompt=PROMPT, n=4)
    ids = engine.encode_prompt(prompt=PROMPT, raw=True)
    by_ids = c.completions.create(model=model_name(server), prompt=ids, n=4)
    assert [x.text for x in text.choices] == [x.text for x in by_ids.choices]
    batch = c.completions.create(model=model_name(server), prompt=[PROMPT, "w5 w6"], n=4)
    assert [x.index for x in batch.choices] == list(range(8))
    assert [x.text for x in batch.choices[:4]] == [x.text for x in text.choices]


def test_streaming_returns_ranked_choices_then_usage(server: ServerProcess) -> None:
    stream = client(server).chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": PROMPT}], n=5,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert len(chunks) == 2
    first, last = chunks
    assert [c.index for c in first.choices] == list(range(5))
    assert all(c.delta.content.startswith("<s_a_") and c.finish_reason == "stop"
               for c in first.choices)  # fmt: skip
    assert last.choices == [] and last.usage.completion_tokens == 15


def test_models_health_ready_metrics(server: ServerProcess, auth: dict[str, str]) -> None:
    _post(server, "/v1/chat/completions", _chat(n=2), auth)  # at least one request was timed
    [card] = client(server).models.list().data
    assert card.id == "genrec-tiny" and card.model_extra["flashrec"]["sid_depth"] == 3
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    metrics = read_metrics(server.url)
    for name in (
        "flashrec_queue_depth",
        "flashrec_kv_slots_free",
        "flashrec_running_beam_rows",
        "flashrec_invalid_results_total",
        "flashrec_prefix_cache_hit_tokens_total",
        "flashrec_engine_admission_retries_total{reason=kv_slots}",
        "flashrec_engine_admission_retries_total{reason=device_memory}",
    ):
        assert name in metrics, name  # fmt: skip
    assert metrics["flashrec_invalid_results_total"] == 0
    assert metrics["flashrec_engine_admission_retries_total{reason=device_memory}"] == 0
    # the request above ran: its slots (at least) are the peak, which stays after it ends
    assert 0 < metrics["flashrec_kv_slots_peak_used"] <= metrics["flashrec_kv_slots_total"]
    assert metrics["flashrec_kv_slots_used"] <= metrics["flashrec_kv_slots_peak_used"]
    assert any(k.startswith("flashrec_request_stage_seconds_bucket") for k in metrics)
    # serving allocates: young collections ran since the app was made, each one recorded
    young = metrics["flashrec_gc_pause_seconds_count{generation=0}"]
    assert young > 0 and metrics["flashrec_gc_pause_seconds_bucket{generation=0,le=+Inf}"] == young
    assert 0 < metrics["flashrec_gc_pause_seconds_sum{generation=0}"] < young  # under 1 s each
    assert metrics["flashrec_gc_young_threshold"] == 10_000  # the setting's default, once ready
    # what `flashrec bench --server` needs for the roofline floor: the served model's budgets
    roofline = card.model_extra["flashrec"]["roofline"]
    assert roofline["kv_slots"] == metrics["flashrec_kv_slots_total"]
    assert roofline["max_wave_rows"] == card.model_extra["flashrec"]["max_beam_rows"]
    assert roofline["weight_bytes"] > 0 and roofline["kv_bytes"] in (1, 2, 4)


def test_request_id_is_echoed(server: ServerProcess, auth: dict[str, str]) -> None:
    r = httpx.get(server.url + "/v1/models", headers={**auth, "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


STAGES = ("intake", "queue", "prefill", "decode", "shaping")


def test_request_stages_split_the_server_latency(
    server: ServerProcess, auth: dict[str, str]
) -> None:
    """Each answered generation request records the HTTP side's intake and shaping around the
    engine's queue, prefill and decode: five disjoint intervals inside the request's latency, so
    their sums over a few requests (chat, a stream, a completion) stay under the latencies'."""
    before = read_metrics(server.url)
    chat = "/v1/chat/completions"
    bodies = [(chat, _chat(n=2)), (chat, _chat(n=3, stream=True)),
              ("/v1/completions", {"prompt": PROMPT, "n": 2})]  # fmt: skip
    for path, body in bodies:
        assert _post(server, path, body, auth).status_code == 200
    after = read_metrics(server.url)

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    stage = "flashrec_request_stage_seconds_{}{{stage={}}}"
    assert [grew(stage.format("count", s)) for s in STAGES] == [len(bodies)] * len(STAGES)
    spent = {s: grew(stage.format("sum", s)) for s in STAGES}
    assert all(seconds > 0 for seconds in spent.values()), spent
    latency = sum(grew(f"flashrec_request_latency_seconds_sum{{endpoint={path}}}")
                  for path in ("/v1/chat/completions", "/v1/completions"))  # fmt: skip
    assert sum(spent.values()) < latency, (spent, latency)


def _post(
    server: ServerProcess, path: str, body: object, headers: dict[str, str]
) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})  # fmt: skip


def _chat(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": PROMPT}], **fields}


BAD_INPUTS = [
    # (id, path, body, status, param)
    ("malformed-json", "/v1/chat/completions", '{"messages": [', 400, None),
    ("not-an-object", "/v1/chat/completions", "[1, 2]", 400, None),
    ("missing-messages", "/v1/chat/completions", {"n": 3}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages-not-list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("n-zero", "/v1/chat/completions", _chat(n=0), 400, "n"),
    ("n-negative", "/v1/chat/completions", _chat(n=-1), 400, "n"),
    ("n-huge", "/v1/chat/completions", _chat(n=10**9), 400, "n"),
    ("n-string", "/v1/chat/completions", _chat(n="five"), 400, "n"),
    ("n-float", "/v1/chat/completions", _chat(n=2.5), 400, "n"),
    ("temperature-nan", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "w1"}],'
     ' "temperature": NaN}', 400, "temperature"),
    ("temperature-negative", "/v1/chat/completions", _chat(temperature=-0.5), 400, "temperature"),
    ("temperature-infinite", "/v1/chat/completions", '{"messages": [{"role": "user", "content":'
     ' "w1"}], "temperature": Infinity}', 400, "temperature"),
    ("empty-prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ("whitespace-prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "  \n\t "}]}, 400, "messages"),
    ("over-long-prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w1 " * 40000}]}, 400, "messages"),
    ("image-part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages[0].content[0].type"),
    ("bad-role", "/v1/chat/completions",
     {"messages": [{"role": "robot", "content": "w1"}]}, 400, "messages[0].role"),
    ("unknown-field", "/v1/chat/completions", _chat(beams=4), 400, "beams"),
    ("max-tokens-short", "/v1/chat/completions", _chat(max_tokens=2), 400, "max_tokens"),
    ("max-completion-tokens-short", "/v1/chat/completions", _chat(max_completion_tokens=1), 400,
     "max_completion_tokens"),
    ("seed-negative", "/v1/chat/completions", _chat(seed=-3), 400, "seed"),
    ("timeout-zero", "/v1/chat/completions", _chat(timeout=0), 400, "timeout"),
    ("unknown-model", "/v1/chat/completions", _chat(model="gpt-9"), 404, "model"),
    ("filters-unknown-attribute", "/v1/chat/completions", _chat(filters={"colour": "red"}), 400,
     "filters"),
    ("filters-bad-value", "/v1/chat/completions", _chat(filters={"colour": {"a": 1}}), 400,
     "filters.colour"),
    ("exclude-items-not-list", "/v1/chat/completions", _chat(exclude_items="i1"), 400,
     "exclude_items"),
    ("prompt-missing", "/v1/completions", {"n": 2}, 400, "prompt"),
    ("prompt-empty-ids", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("prompt-id-out-of-vocab", "/v1/completions", {"prompt": [1, 10**7]}, 400, "prompt[1]"),
    ("prompt-negative-id", "/v1/completions", {"prompt": [-1]}, 400, "prompt[0]"),
    ("prompt-id-past-64-bits", "/v1/completions", {"prompt": [1, 2**70]}, 400, "prompt[1]"),
    ("prompt-whitespace", "/v1/completions", {"prompt": "   "}, 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", {"prompt": {"text": "w1"}}, 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,status,param", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gets_4xx_naming_the_field(
    server: ServerProcess, auth: dict[str, str], path: str, body: object, status: int,
    param: str | None,
) -> None:  # fmt: skip
    r = _post(server, path, body, auth)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    good = _post(server, "/v1/chat/completions", _chat(n=2), auth)
    assert good.status_code == 200 and len(good.json()["choices"]) == 2


def test_a_chunked_body_is_answered(server: ServerProcess, auth: dict[str, str]) -> None:
    """A body sent without Content-Length (chunked) is tokenized on a worker thread, not
    inline: it is answered like any other."""
    raw = json.dumps(_chat(n=3)).encode()
    pieces = iter([raw[:10], raw[10:]])  # an iterator: httpx sends it chunked
    r = httpx.post(server.url + "/v1/chat/completions", content=pieces, timeout=60,
                   headers={"content-type": "application/json", **auth})  # fmt: skip
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_auth_and_routes(server: ServerProcess, auth: dict[str, str]) -> None:
    no_key = _post(server, "/v1/chat/completions", _chat(), {})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    wrong = _post(server, "/v1/chat/completions", _chat(), {"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with pytest.raises(APIStatusError) as info:
        client(server, key="wrong").models.list()
    assert info.value.status_code == 401
    missing = httpx.get(server.url + "/v1/nothing", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(server.url + "/v1/chat/completions", headers=auth)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert httpx.get(server.url + "/health").status_code == 200, "probes need no key"


def test_without_an_api_key_no_route_asks_for_one(checkpoint: Path) -> None:
    keyed = server_args(checkpoint)
    at = keyed.index("--api-key")
    with ServerProcess(keyed[:at] + keyed[at + 2 :]) as proc:  # no key: the routes are open
        with httpx.Client(base_url=proc.url, timeout=60) as c:
            assert c.get("/v1/models").status_code == 200
            assert c.get("/v1/catalogs").status_code == 200
            answer = c.post("/v1/completions", json={"prompt": [1, 2, 3], "n": 2})
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["choices"]) == 2


def test_timeout_gives_504_and_frees_everything(
    server: ServerProcess, auth: dict[str, str]
) -> None:
    r = _post(server, "/v1/chat/completions", _chat(n=64, timeout=1e-6), auth)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert_idle(server)


def assert_idle(server: ServerProcess, within_s: float = 10.0) -> None:
    """Every request slot, KV slot and prefix-cache lock is back to its idle value."""
    import time

    end = time.monotonic() + within_s
    while True:
        m = read_metrics(server.url)
        idle = {
            "queue": m["flashrec_queue_depth"], "running": m["flashrec_running_requests"],
            "rows": m["flashrec_running_beam_rows"], "kv_used": m["flashrec_kv_slots_used"],
            "request_slots": m["flashrec_request_slots_used"],
            "locks": m["flashrec_prefix_cache_locked_nodes"],
        }  # fmt: skip
        if not any(idle.values()):
            assert (
                m["flashrec_kv_slots_free"] + m["flashrec_kv_slots_cached"]
                == m["flashrec_kv_slots_total"]
            )
            return
        if time.monotonic() > end:
            raise AssertionError(f"not idle after {within_s} s: {idle}")
        time.sleep(0.05)


def test_item_filters_through_the_api(server: ServerProcess, engine: Engine) -> None:
    c = client(server)
    plain = c.chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": PROMPT}], n=6
    )
    top = [x.model_extra["flashrec"]["items"][0] for x in plain.choices[:3]]
    filtered = c.chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": PROMPT}], n=6,
        extra_body={"exclude_items": top},
    )  # fmt: skip
    got = [i for x in filtered.choices for i in x.model_extra["flashrec"]["items"]]
    assert len(filtered.choices) == 6 and not set(got) & set(top)
    allow = [f"item-{i:06d}" for i in range(0, 1500, 300)]
    only = c.completions.create(
        model=model_name(server), prompt=PROMPT, n=10, extra_body={"allow_items": allow}
    )
    assert {x.model_extra["flashrec"]["items"][0] for x in only.choices} == set(allow)
    assert only.model_extra["flashrec"]["notes"], "fewer allowed items than n: a note says so"
    r = _post(server, "/v1/chat/completions", _chat(allow_items=["no-such-item"]),
              {"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "allow_items"
