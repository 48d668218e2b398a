"""10,000 requests with random exclude lists, allow-lists and both against the live server:
an item a request filtered out is never returned, and every answer has as many choices as the
filtered catalog allows (n or all that is left)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx

from flashrec_core.testing.server_process import ServerProcess, read_metrics

from .conftest import API_KEY

REQUESTS = 10_000


def test_filtered_items_never_come_back(server: ServerProcess, checkpoint: Path) -> None:
    items = sorted(json.loads((checkpoint / "catalog.json").read_text()).values())
    rng = random.Random(11)
    bodies, rules = [], []
    for i in range(REQUESTS):
        body: dict = {
            "prompt": f"user history w{i % 48} w{(i * 7) % 48}",
            "n": rng.choice([1, 4, 16]),
        }
        kind = i % 3
        excluded = set(rng.sample(items, rng.randint(1, 300))) if kind != 1 else set()
        allowed = set(rng.sample(items, rng.randint(1, 40))) if kind != 0 else None
        if excluded:
            body["exclude_items"] = sorted(excluded)
        if allowed is not None:
            body["allow_items"] = sorted(allowed)
        bodies.append(body)
        rules.append((excluded, allowed))

    async def send() -> list[httpx.Response]:
        limit = asyncio.Semaphore(64)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as c:

            async def one(body: dict) -> httpx.Response:
                async with limit:
                    return await c.post("/v1/completions", json=body)

            return await asyncio.gather(*(one(b) for b in bodies))

    start = read_metrics(server.url)
    answers = asyncio.run(send())
    returned, closed = 0, 0
    for body, (excluded, allowed), r in zip(bodies, rules, answers):
        if r.status_code == 400:  # an allow-list wholly excluded: refused, with the field named
            assert allowed is not None and not (allowed - excluded), r.text
            assert r.json()["error"]["param"] == "allow_items"
            continue
        assert r.status_code == 200, r.text
        got = [i for ch in r.json()["choices"] for i in ch["flashrec"]["items"]]
        assert not set(got) & excluded, "an excluded item came back"
        assert allowed is None or set(got) <= allowed, "an item outside the allow-list came back"
        left = len(allowed - excluded) if allowed is not None else len(items) - len(excluded)
        assert len(r.json()["choices"]) == min(body["n"], left)
        returned += len(got)
        closed += len(items) - left  # one item per SID in this catalog: the SIDs it closed
    assert returned > REQUESTS
    after = read_metrics(server.url)

    def counted(name: str) -> float:
        return after[name] - start.get(name, 0)

    assert counted("flashrec_filtered_requests_total") >= REQUESTS * 0.99
    assert counted("flashrec_filtered_sids_total") == closed
    assert after["flashrec_invalid_results_total"] == 0
