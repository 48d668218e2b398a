"""Radix prefix cache: matching, splitting, ownership of slots, locking, LRU eviction, and the
engine giving the same results with the cache on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.kvcache import RadixCache, SlotAllocator
from flashrec_core.testing.checkpoint import write_tiny_checkpoint


def _cache(slots: int = 64) -> tuple[RadixCache, SlotAllocator]:
    alloc = SlotAllocator(slots)
    return RadixCache(alloc), alloc


def _accounted(cache: RadixCache, alloc: SlotAllocator) -> bool:
    return cache.num_cached + alloc.num_free == alloc.num_slots - 1


def test_match_insert_and_split() -> None:
    cache, alloc = _cache()
    a = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], a)
    slots, _ = cache.match([1, 2, 3, 9], limit=4)
    assert torch.equal(slots, a[:3]), "a match ending inside an edge returns its prefix"
    b = alloc.alloc(4)
    cache.insert([1, 2, 3, 7], torch.cat([a[:3], b[3:]]))
    alloc.free(b[:3])  # the caller's own unused allocation for the shared part
    slots, _ = cache.match([1, 2, 3, 7, 8], limit=5)
    assert torch.equal(slots, torch.cat([a[:3], b[3:]]))
    assert cache.num_cached == 6 and _accounted(cache, alloc)


def test_insert_frees_recomputed_duplicates() -> None:
    cache, alloc = _cache()
    first, second = alloc.alloc(4), alloc.alloc(4)
    cache.insert([5, 6, 7, 8], first)
    cache.insert([5, 6, 7, 8], second)  # same prompt computed twice in one wave
    assert cache.num_cached == 4 and _accounted(cache, alloc)
    assert torch.equal(cache.match([5, 6, 7, 8], 4)[0], first)


def test_match_respects_limit() -> None:
    cache, alloc = _cache()
    cache.insert([1, 2, 3], alloc.alloc(3))
    slots, _ = cache.match([1, 2, 3], limit=2)
    assert slots.numel() == 2, "the last prompt token must always be recomputed"


def test_locked_paths_survive_eviction_and_lru_order() -> None:
    cache, alloc = _cache()
    old = cache.insert([1, 1, 1], alloc.alloc(3))
    cache.insert([2, 2, 2], alloc.alloc(3))
    cache.insert([3, 3, 3], alloc.alloc(3))
    _, node = cache.match([3, 3, 3], 3)  # touch: most recent
    cache.lock(old)
    freed = cache.evict(3)
    assert freed == 3 and cache.match([2, 2, 2], 3)[0].numel() == 0, "LRU unlocked leaf goes"
    assert cache.match([1, 1, 1], 3)[0].numel() == 3, "locked path is kept"
    assert cache.evict(100) == 3 and cache.match([1, 1, 1], 3)[0].numel() == 3
    cache.unlock(old)
    assert cache.evict(100) == 3 and cache.num_cached == 0 and _accounted(cache, alloc)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrec_models_qwen3 import spec

    path = tmp_path_factory.mktemp("radix")
    write_tiny_checkpoint(path, spec.examples[0].hf_config, level_sizes=(16, 16, 16))
    catalog = {f"{a},{b},{(a * b) % 16}": f"i{a}-{b}" for a in range(16) for b in range(16)}
    (path / "catalog.json").write_text(json.dumps(catalog))
    return path


def _engine(path: Path, cache: bool, tokens: int = 1 << 14) -> Engine:
    cfg = EngineConfig(
        model_path=str(path), device="cpu", prefix_cache=cache, kv_cache_tokens=tokens,
        show_progress=False,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "catalog.json")))


PROMPTS = [
    "user history w1 w2 w3 w4 w5 w6 w7 item w8",
    "user history w1 w2 w3 w4 w5 w6 w7 item w9",
    "user history w1 w2 w3 w4 w5 next w10",
]


def test_engine_results_equal_with_and_without_cache(checkpoint: Path) -> None:
    plain, cached = _engine(checkpoint, False), _engine(checkpoint, True)
    for _ in range(2):  # the second round hits the cache for every prompt
        for prompt in PROMPTS:
            [a] = plain.generate([plain.make_request(prompt=prompt, n=8)])
            [b] = cached.generate([cached.make_request(prompt=prompt, n=8)])
            assert [c.codes for c in a.choices] == [c.codes for c in b.choices]
            for x, y in zip(a.choices, b.choices):
                assert abs(x.logprob - y.logprob) < 1e-5  # fp32; K/V recomputed vs reused
    ids = cached.make_request(prompt=PROMPTS[0], n=1).prompt_ids
    hit, _ = cached.runner.prefix_cache.match(ids, len(ids) - 1)
    assert hit.numel() == len(ids) - 1, "a repeated prompt is served from the cache"
    runner = cached.runner
    assert (
        runner.allocator.num_free + runner.prefix_cache.num_cached == runner.allocator.num_slots - 1
    )


def test_engine_evicts_cached_prefixes_when_the_pool_is_short(checkpoint: Path) -> None:
    engine = _engine(checkpoint, True, tokens=80)  # room for about one wave at a time
    for i in range(12):
        [res] = engine.generate([engine.make_request(prompt=f"w{i} w{i + 1} w{i + 2} item", n=8)])
        assert len(res.choices) == 8
    runner = engine.runner
    assert runner.prefix_cache.num_cached < 80
    assert (
        runner.allocator.num_free + runner.prefix_cache.num_cached == runner.allocator.num_slots - 1
    )


def test_evict_takes_oldest_leaves_then_their_emptied_parents() -> None:
    alloc = SlotAllocator(200)
    cache = RadixCache(alloc)
    shared = [1, 2, 3, 4]
    for i in range(5):  # five prompts below one shared 4-token node
        tokens = shared + [10 + i, 20 + i]
        cache.insert(tokens, alloc.alloc(len(tokens)))
    locked = cache.match(shared + [14, 24], 6)[1]
    cache.lock(locked)  # the newest prompt is in use
    free = alloc.num_free
    assert cache.evict(3) == 4, "the two oldest 2-token leaves"
    assert alloc.num_free == free + 4
    assert cache.match(shared + [10, 20], 6)[0].numel() == 4, "oldest leaf gone, prefix kept"
    assert cache.evict(100) == 4, "the other unlocked leaves; the locked path and its prefix stay"
    assert cache.match(shared + [14, 24], 6)[0].numel() == 6
    cache.unlock(locked)
    assert cache.evict(100) == 6, "the last leaf, then its emptied parent"
    assert cache.num_cached == 0 and alloc.num_free == 199
