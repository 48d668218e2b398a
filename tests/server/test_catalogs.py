"""Several named catalogs per server and hot reload under load: every answer is valid under the
catalog version it reports, a bad catalog is refused while the old one keeps serving, and
replaced versions leave memory once their last request ends."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from flashrec_core.testing.server_process import ServerProcess, read_metrics

from .conftest import API_KEY, server_args
from .test_api import assert_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _variant(checkpoint: Path, tmp: Path, prefix: str, keep_every: int) -> tuple[Path, set[str]]:
    """A catalog over a subset of the checkpoint's SIDs with its own item ids."""
    base = json.loads((checkpoint / "catalog.json").read_text())
    out = {
        sid: f"{prefix}-{item}" for i, (sid, item) in enumerate(base.items()) if i % keep_every == 0
    }
    path = tmp / f"{prefix}.json"
    path.write_text(json.dumps(out))
    return path, set(out.values())


@pytest.fixture
def catalogs_server(checkpoint: Path, tmp_path: Path):
    a, a_items = _variant(checkpoint, tmp_path, "a", 1)
    b, b_items = _variant(checkpoint, tmp_path, "b", 2)
    args = server_args(checkpoint, "--catalog", f"shop={a}")
    with ServerProcess(args) as proc:
        yield proc, {"a": (a, a_items), "b": (b, b_items)}


def _body(prompt: str, n: int, catalog: str | None = None) -> dict:
    body: dict = {"messages": [{"role": "user", "content": prompt}], "n": n}
    if catalog:
        body["catalog"] = catalog
    return body


def test_named_catalogs_are_listed_and_picked_per_request(catalogs_server) -> None:
    server, files = catalogs_server
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        listed = c.get("/v1/catalogs").json()
        assert [x["name"] for x in listed["data"]] == ["default", "shop"]
        r = c.post("/v1/chat/completions", json=_body("w1 w2", 5, "shop")).json()
        assert r["flashrec"]["catalog"] == "shop"
        assert {i for ch in r["choices"] for i in ch["flashrec"]["items"]} <= files["a"][1]
        unknown = c.post("/v1/chat/completions", json=_body("w1", 2, "nope"))
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "catalog"
        default = c.post("/v1/chat/completions", json=_body("w1", 2)).json()
        assert default["flashrec"]["catalog"] == "default"


def test_bad_catalog_is_refused_and_the_old_one_keeps_serving(catalogs_server, tmp_path) -> None:
    server, _ = catalogs_server
    bad = tmp_path / "bad.json"
    bad.write_text('{"1,2": "too-shallow"}')
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        before = c.get("/v1/catalogs").json()["data"][1]["version"]
        for body in ({"path": str(bad)}, {"path": "/no/such/file.json"}, {"catalog": {"x": 1}},
                     {}):  # fmt: skip
            r = c.post("/v1/catalogs/shop", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] in ("path", "catalog")
        assert c.get("/v1/catalogs").json()["data"][1]["version"] == before
        assert c.post("/v1/chat/completions", json=_body("w1", 3, "shop")).status_code == 200
        assert c.post("/v1/catalogs/shop", headers={"Authorization": "Bearer no"},
                      json={"path": str(bad)}).status_code == 401  # fmt: skip
        assert c.delete("/v1/catalogs/default").status_code == 400
        assert c.delete("/v1/catalogs/shop").status_code == 200
        assert c.post("/v1/chat/completions", json=_body("w1", 3, "shop")).status_code == 404


def test_swaps_under_load_every_answer_valid_under_its_version(catalogs_server) -> None:
    server, files = catalogs_server
    items_of: dict[int, set[str]] = {}
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        items_of[c.get("/v1/catalogs").json()["data"][1]["version"]] = files["a"][1]
    stop = threading.Event()
    swaps: list[int] = []

    def swapper() -> None:
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
            turn = 0
            while not stop.is_set():
                path, items = files["b" if turn % 2 == 0 else "a"]
                r = c.post("/v1/catalogs/shop", json={"path": str(path)})
                assert r.status_code == 200, r.text
                items_of[r.json()["version"]] = items
                swaps.append(r.json()["version"])
                turn += 1
                time.sleep(0.3)

    async def load() -> list[httpx.Response]:
        """Rounds of 100 requests, 32 in flight, until at least 300 are answered and the
        swapper has swapped three times: how long 300 requests take depends on the machine
        (a fast one answered them within two swaps), the swaps under load must not."""
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=120) as c:

            async def one(i: int) -> httpx.Response:
                async with limit:
                    body = _body(
                        f"user history w{i % 40} w{(i * 3) % 40}", [2, 5, 9][i % 3], "shop"
                    )
                    return await c.post("/v1/chat/completions", json=body)

            answers: list[httpx.Response] = []
            while len(answers) < 300 or (len(swaps) < 3 and len(answers) < 3000):
                first = len(answers)
                answers += await asyncio.gather(*(one(i) for i in range(first, first + 100)))
            return answers

    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        answers = asyncio.run(load())
    finally:
        stop.set()
        thread.join()
    assert len(swaps) >= 3, "the catalog was swapped during the load"
    assert [r.status_code for r in answers] == [200] * len(answers)
    seen = set()
    for r in answers:
        body = r.json()
        version = body["flashrec"]["catalog_version"]
        seen.add(version)
        got = {i for ch in body["choices"] for i in ch["flashrec"]["items"]}
        assert got and got <= items_of[version], f"answer not valid under version {version}"
    assert len(seen) >= 2, "answers came from several versions"
    assert_idle(server)
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        c.post("/v1/chat/completions", json=_body("w1", 2, "shop"))  # a wave after the drain
        listed = c.get("/v1/catalogs").json()
    current = {(x["name"], x["version"]) for x in listed["data"]}
    live = {(x["name"], x["version"]) for x in listed["live_versions"]}
    assert live == current, f"replaced versions still in memory: {live - current}"
    assert read_metrics(server.url)["flashrec_catalog_live_versions"] == len(current)
