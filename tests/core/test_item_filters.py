"""Per-request item filters inside the search, against brute force: the engine's filtered beam
search equals transformers' beam search over the filtered catalog (same SIDs, same order, ties
aside), and with n >= the filtered catalog it returns every allowed SID, ranked as exhaustive
teacher-forced scoring ranks them. Excluded items never come back."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.catalogs import CatalogNotFoundError
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.search.filters import FilterError, FilterMasks, ItemFilter, unpack_bits
from flashrec_core.testing.beam_conformance import ATOL_SAME_ENGINE
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.hf_beam import (
    assert_same_ranking,
    hf_beam_search,
    teacher_forced_logprob,
)

LEVELS = (16, 16, 16)
ATOL = 1e-4  # fp32 engine vs fp32 transformers over 3 levels (see beam_conformance)
PROMPTS = ("user history w1 w7 w3 item w9", "w12 w40 next", "w3 w3 w5")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("filters")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    hf = write_tiny_checkpoint(path, spec.examples[0].hf_config, level_sizes=LEVELS, seed=4)
    rng = random.Random(9)
    codes = sorted({tuple(rng.randrange(k) for k in LEVELS) for _ in range(260)})
    # every 7th SID is shared by two items
    catalog = {",".join(map(str, c)): [f"i{j}", f"j{j}"] if j % 7 == 0 else f"i{j}"
               for j, c in enumerate(codes)}  # fmt: skip
    (path / "catalog.json").write_text(json.dumps(catalog))
    config = EngineConfig(
        model_path=str(path), device="cpu", kv_cache_tokens=1 << 14, show_progress=False
    )
    catalog = str(path / "catalog.json")
    # keyed by normalization (the catalog's automatic trie, dense at this size) and by
    # (normalization, trie kind) for the exactness test, which runs both tries
    engines: dict = {
        norm: Engine.from_config(config, SearchConfig(catalog_path=catalog, sid_normalization=norm))
        for norm in ("level", "sid")
    }
    for norm in ("level", "sid"):
        engines[norm, "dense"] = engines[norm]
        engines[norm, "csr"] = Engine.from_config(
            config, SearchConfig(catalog_path=catalog, sid_normalization=norm, trie_kind="csr")
        )
    return engines, hf


def _allowed_codes(engine: Engine, request) -> np.ndarray:
    return engine.catalog.codes[request.item_filter.sid_mask]


def _random_filter(engine: Engine, rng: random.Random) -> dict:
    items = [i for group in engine.catalog.items for i in group]
    kind = rng.choice(["exclude", "allow", "both"])
    out: dict = {}
    if kind in ("exclude", "both"):
        out["exclude_items"] = rng.sample(items, rng.randint(1, len(items) // 2))
    if kind in ("allow", "both"):
        out["allow_items"] = rng.sample(items, rng.randint(3, len(items) // 2))
    return out


@pytest.mark.parametrize("trie", ["dense", "csr"])
@pytest.mark.parametrize("normalization", ["level", "sid"])
@pytest.mark.parametrize("trial", range(6))
def test_filtered_search_equals_beam_search_over_the_filtered_catalog(
    setup, normalization: str, trial: int, trie: str
) -> None:
    engines, hf = setup
    engine = engines[normalization, trie]
    assert type(engine.wave.trie).__name__ == {"dense": "DenseTrie", "csr": "CsrTrie"}[trie]
    rng = random.Random(100 + trial)
    requests = []
    for p in PROMPTS:
        try:
            requests.append(engine.make_request(prompt=p, n=rng.choice([2, 5, 12]),
                                                **_random_filter(engine, rng)))  # fmt: skip
        except FilterError:  # an allow-list wholly excluded: nothing to search
            continue
    requests.append(engine.make_request(prompt=PROMPTS[0], n=6))  # unfiltered, same wave
    for req, res in zip(requests, engine.generate(requests)):
        allowed = _allowed_codes(engine, req) if req.item_filter else engine.catalog.codes
        ref = hf_beam_search(hf, req.prompt_ids, req.n, engine.layout, allowed, normalization)
        assert_same_ranking([(c.codes, c.logprob) for c in res.choices], ref, ATOL)
        if req.item_filter is not None:
            f = req.item_filter
            assert all(f.keeps(i) for c in res.choices for i in c.items)
            assert all(c.items for c in res.choices), "every returned SID keeps an allowed item"


def test_n_over_the_filtered_catalog_returns_every_allowed_sid_exactly(setup) -> None:
    engines, hf = setup
    engine = engines["level"]
    allow = [f"i{j}" for j in (3, 14, 15, 92, 150, 151, 200, 7)] + ["j7", "missing-item"]
    req = engine.make_request(prompt=PROMPTS[1], n=16, allow_items=allow, exclude_items=["i7"])
    [res] = engine.generate([req])
    allowed = _allowed_codes(engine, req)
    assert len(allowed) == 8, "i7 is excluded but its SID stays: it also names the allowed j7"
    expected = sorted(((tuple(c), teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c))
                       for c in allowed.tolist()), key=lambda x: -x[1])  # fmt: skip
    assert_same_ranking([(c.codes, c.logprob) for c in res.choices], expected, ATOL)
    shared = next(c for c in res.choices if "j7" in c.items)
    assert shared.items == ("j7",), "only the allowed item of a shared SID comes back"
    assert res.notes and "only 8 valid items" in res.notes[0]


def test_excluded_items_never_come_back_fuzz(setup) -> None:
    engines, _ = setup
    engine = engines["level"]
    rng = random.Random(3)
    items = [i for group in engine.catalog.items for i in group]
    returned = 0
    for _batch in range(4):
        reqs = []
        for _ in range(100):
            exclude = rng.sample(items, 120)
            reqs.append(engine.make_request(prompt=rng.choice(PROMPTS), n=8, exclude_items=exclude))
        for req, res in zip(reqs, engine.generate(reqs)):
            assert len(res.choices) == 8, "the filtered catalog holds far more than n"
            for c in res.choices:
                assert c.items and not set(c.items) & req.item_filter.excluded
                returned += 1
    assert returned == 3200


def test_filters_that_name_nothing_are_errors(setup) -> None:
    engine = setup[0]["level"]
    with pytest.raises(FilterError, match="no catalog item is left after allow_items") as info:
        engine.make_request(prompt="w1", n=2, allow_items=["nope"])
    assert info.value.param == "allow_items"
    with pytest.raises(FilterError):
        engine.make_request(prompt="w1", n=2, allow_items=["i3"], exclude_items=["i3"])


@pytest.fixture(scope="module", params=["dense", "csr"])
def with_metadata(setup, tmp_path_factory: pytest.TempPathFactory, request):
    """The same model and SIDs, the catalog in its metadata form: a category and a stock flag
    per item; once with each trie."""
    engines, hf = setup
    base = engines["level"]
    path = tmp_path_factory.mktemp("meta") / "catalog.json"
    sids = {",".join(map(str, c)): list(items) for c, items in
            zip(base.catalog.codes.tolist(), base.catalog.items)}  # fmt: skip
    items = {item: {"category": ["books", "music", "film"][int(item[1:]) % 3],
                    "in_stock": int(item[1:]) % 4 != 0}
             for group in base.catalog.items for item in group}  # fmt: skip
    path.write_text(json.dumps({"sids": sids, "items": items}))
    engine = Engine.from_config(
        base.runner.loaded.engine_config,
        SearchConfig(catalog_path=str(path), trie_kind=request.param),
    )
    return engine, hf


def test_attribute_filters_match_beam_search_over_matching_items(with_metadata) -> None:
    engine, hf = with_metadata
    meta = engine.catalog.metadata
    wanted = {"category": ["books", "film"], "in_stock": True}
    for prompt, n in zip(PROMPTS, (3, 8, 20)):
        req = engine.make_request(prompt=prompt, n=n, filters=wanted, exclude_items=["i3"])
        [res] = engine.generate([req])
        for c in res.choices:
            assert c.items and "i3" not in c.items
            assert all(meta[i]["category"] in wanted["category"] and meta[i]["in_stock"]
                       for i in c.items)  # fmt: skip
        allowed = _allowed_codes(engine, req)
        ref = hf_beam_search(hf, req.prompt_ids, n, engine.layout, allowed, "level")
        assert_same_ranking([(c.codes, c.logprob) for c in res.choices], ref, ATOL)


def test_unknown_attributes_and_empty_results_are_errors(with_metadata) -> None:
    engine, _ = with_metadata
    with pytest.raises(FilterError, match="category, in_stock") as info:
        engine.make_request(prompt="w1", n=2, filters={"colour": "red"})
    assert info.value.param == "filters"
    with pytest.raises(FilterError, match="no catalog item is left after filters"):
        engine.make_request(prompt="w1", n=2, filters={"category": "poetry"})


def test_an_allow_all_filter_changes_nothing(setup) -> None:
    """The filter warm-up uses to capture filtered graphs returns what no filter returns."""
    engines, _ = setup
    engine = engines["level"]
    plain = engine.make_request(prompt="user w3 w4 item", n=6)
    allow_all = replace(plain, item_filter=engine.catalog_index.allow_all())
    a, b = engine.generate([plain, allow_all])
    assert [(c.codes, c.items) for c in a.choices] == [(c.codes, c.items) for c in b.choices]
    assert_same_ranking(
        [(c.codes, c.logprob) for c in a.choices], [(c.codes, c.logprob) for c in b.choices],
        ATOL_SAME_ENGINE,
    )  # fmt: skip


def test_warm_up_runs_every_catalog_version_and_a_reload_warms_before_the_swap(
    setup, tmp_path
) -> None:
    from flashrec_core.server.warmup import warm_up

    engines, _ = setup
    engine = engines["sid"]
    codes = engine.catalog.codes[:40]
    path = tmp_path / "small.json"
    path.write_text(json.dumps({",".join(map(str, c)): f"s{j}" for j, c in enumerate(codes)}))
    seen = []

    def before_swap(version) -> None:
        with pytest.raises(CatalogNotFoundError):
            engine.catalogs.get("small")  # not served until warmed
        seen.append(warm_up(engine, [4, 8], [version], progress=False))

    version, replaced = engine.add_catalog("small", path, before_swap)
    assert replaced is None and seen == [2], "one wave per width on CPU (no graphs to capture)"
    assert engine.catalogs.get("small") is version
    assert warm_up(engine, [4], progress=False) == 2, "the default and the new catalog"
    engine.catalogs.remove("small")


def test_packed_filter_bits_unpack_to_the_sid_masks() -> None:
    """What a GPU wave uploads (np.packbits rows) unpacks to the same masks."""
    rng = np.random.default_rng(3)
    for num in (1, 7, 8, 9, 1001):
        masks = rng.random((3, num)) < 0.3
        packed = torch.from_numpy(np.stack([np.packbits(m) for m in masks]))
        assert np.array_equal(unpack_bits(packed, num).numpy().astype(bool), masks)


def test_a_search_only_filter_opens_what_the_full_filter_opens(setup) -> None:
    """The engine process rebuilds each filter from its SID bits alone (`for_search`): the same
    SID mask, the same closed count and the same level masks; it has no items to keep."""
    engine = setup[0]["level"]
    rng = random.Random(11)
    full = [engine.create_filter(**_random_filter(engine, rng)) for _ in range(4)]
    bits = [ItemFilter.for_search(f.packed_sids.copy(), f.index) for f in full]
    trie, cpu = engine.catalogs.get().host_trie, torch.device("cpu")
    for f, b in zip(full, bits):
        assert np.array_equal(b.sid_mask, f.sid_mask) and b.num_closed == f.num_closed > 0
    for a, b in zip(FilterMasks.create(full, engine.catalog_index, trie, cpu).levels,
                    FilterMasks.create(bits, engine.catalog_index, trie, cpu).levels):  # fmt: skip
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="search-only"):
        bits[0].keeps(engine.catalog_index.item_ids[0])


@pytest.mark.parametrize("group", [16, 4])
@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_level_masks_open_exactly_the_prefixes_with_an_allowed_sid(
    setup, kind: str, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each inner level's mask, built from running counts over contiguous runs, equals the
    brute-force rule: a prefix is open when some allowed SID starts with it; also when the
    masks are built in groups of 4 requests (the 6 here: a full group and a partial one)."""
    from flashrec_core.search import filters as filters_module

    monkeypatch.setattr(filters_module, "MASK_GROUP_REQUESTS", group)
    engine = setup[0]["level", kind]
    catalog, trie = engine.catalog, engine.catalogs.get().host_trie
    rng = random.Random(5)
    filters = [None, *(engine.create_filter(**_random_filter(engine, rng)) for _ in range(5))]
    masks = FilterMasks.create(filters, engine.catalog_index, trie, torch.device("cpu"))
    for b, f in enumerate(filters):
        allowed = catalog.codes if f is None else catalog.codes[f.sid_mask]
        for d, level in enumerate(masks.levels[:-1]):
            nodes = engine.catalog_index.ancestors[d]
            prefixes = {tuple(c[: d + 1]) for c in catalog.codes.tolist()}
            assert level.shape[1] == len(prefixes) == nodes.max() + 1
            open_ = {tuple(c[: d + 1]) for c in allowed.tolist()}
            for row, code in enumerate(catalog.codes.tolist()):
                assert bool(level[b, nodes[row]]) == (tuple(code[: d + 1]) in open_), (b, d, row)
        assert np.array_equal(masks.levels[-1][b].numpy(), np.ones(len(catalog), bool)
                              if f is None else f.sid_mask)  # fmt: skip


def test_requests_without_a_catalog_version_follow_a_reload_of_default(setup, tmp_path) -> None:
    from flashrec_core.engine.requests import GenerationRequest

    engines, _ = setup
    engine = engines["level"]
    original = engine.catalogs.get()
    codes = engine.catalog.codes[::5]
    path = tmp_path / "default.json"
    path.write_text(json.dumps({",".join(map(str, c)): f"d{j}" for j, c in enumerate(codes)}))
    prompt = engine.make_request(prompt="user w1 w2 item", n=4).prompt_ids
    try:
        engine.add_catalog("default", path)
        [res] = engine.generate([GenerationRequest(prompt, 4)])  # no version given
        allowed = {tuple(c) for c in codes.tolist()}
        assert res.choices and all(c.codes in allowed for c in res.choices)
        assert all(i.startswith("d") for c in res.choices for i in c.items)
    finally:
        engine.add_catalog("default", original.source)
