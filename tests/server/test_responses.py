"""Response shaping from a result's arrays: item lists (flattened, de-duplicated, n_items), the
max_per_prefix diversity cap, and through the live server."""

from __future__ import annotations

import numpy as np

from flashrec_core.engine.requests import GenerationResult, ResultDecoder
from flashrec_core.search.catalog import build_catalog
from flashrec_core.server import responses
from flashrec_core.testing.server_process import ServerProcess

from .test_api import PROMPT, client, model_name


def _result(engine) -> GenerationResult:
    catalog = build_catalog(
        np.array([[0, 1, 2], [0, 3, 4], [0, 5, 5], [1, 1, 1]]),  # sorted, as catalogs are
        [("a", "b"), ("b",), ("c",), ("d",)], engine.layout.level_sizes,
    )  # fmt: skip
    decoder = ResultDecoder(engine.layout, catalog, 1.0)
    return GenerationResult(
        codes=catalog.codes, logprobs=np.array([-1.0, -2.0, -3.0, -4.0], dtype=np.float32),
        nodes=np.arange(4), prompt_tokens=3, requested=4, decoder=decoder,
        level_logprobs=np.zeros((4, 3), dtype=np.float32),
    )  # fmt: skip


def test_items_are_flattened_in_rank_order_without_repeats(engine) -> None:
    result = _result(engine)
    body = responses.chat_completion("x", "m", result, responses.Shaping(n_items=10))
    items = body["flashrec"]["items"]
    assert [i["item"] for i in items] == ["a", "b", "c", "d"]
    assert [i["rank"] for i in items] == [0, 0, 2, 3] and body["flashrec"][
        "deduplicated_items"
    ] == 1
    first = responses.chat_completion("x", "m", result, responses.Shaping(n_items=3))
    assert [i["item"] for i in first["flashrec"]["items"]] == ["a", "b", "c"]


def test_max_per_prefix_caps_choices_sharing_a_first_code(engine) -> None:
    result = _result(engine)
    capped = responses.chat_completion("x", "m", result, responses.Shaping(max_per_prefix=1))
    assert [c["flashrec"]["codes"][0] for c in capped["choices"]] == [0, 1]
    assert [c["flashrec"]["rank"] for c in capped["choices"]] == [0, 3]
    plain = responses.chat_completion("x", "m", result)
    assert len(plain["choices"]) == 4, "without the cap, results are unchanged"


def test_item_results_through_the_server(server: ServerProcess) -> None:
    c = client(server)
    resp = c.chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": PROMPT}], n=12,
        extra_body={"return": "items", "n_items": 5, "max_per_prefix": 2},
    )  # fmt: skip
    firsts = [x.model_extra["flashrec"]["codes"][0] for x in resp.choices]
    assert all(firsts.count(f) <= 2 for f in firsts)
    items = resp.model_extra["flashrec"]["items"]
    assert len(items) == 5 and len({i["item"] for i in items}) == 5
    assert [i["item"] for i in items] == [x.model_extra["flashrec"]["items"][0]
                                          for x in resp.choices[:5]]  # fmt: skip
