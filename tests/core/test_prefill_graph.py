"""Prefill graphs' shapes and padding (pure logic and the torch reference path: runs on CPU; the
replays themselves are checked in tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.engine.prefill_graph import pad_prefill, prefill_shape, token_buckets
from flashrec_core.kvcache.pool import KVPool

ATOL_ROWS = 1e-5
"""fp32 on CPU: the same rows through GEMMs of a different row count (BLAS may block them
differently); a pad token leaking into a real sequence moves hidden states by O(1)."""


def test_buckets_end_at_the_setting() -> None:
    assert token_buckets(8192) == [128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192]
    assert token_buckets(5000) == [128, 256, 512, 1024, 2048, 3072, 4096, 5000]
    assert token_buckets(100) == [100]
    assert token_buckets(0) == []


@pytest.mark.parametrize(
    ("tokens", "requests", "shape"),
    [
        (1023, 1, (1024, 2)),  # one prompt after a one-token cached prefix, one pad token
        (1024, 1, (2048, 2)),  # no room left for the pad sequence's token
        (960, 3, (1024, 5)),
        (4000, 8, (4096, 9)),
        (8000, 16, (8192, 17)),
        (8192, 16, None),  # over the largest bucket once padded: eager
        (100, 17, None),  # more requests than any sequence bucket: eager
    ],
)
def test_a_prefill_replays_the_smallest_shape_that_holds_it(
    tokens: int, requests: int, shape: tuple[int, int] | None
) -> None:
    assert prefill_shape(tokens, requests, token_buckets(8192)) == shape


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("prefill") / "ckpt"
    write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=200, seed=2)
    cfg = EngineConfig(model_path=str(path), device="cpu", kv_cache_tokens=4096,
                       show_progress=False)  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "catalog.json")))


def _last(step) -> torch.Tensor:
    return step.qo_indptr[1:] - 1


@pytest.mark.parametrize("cached", [False, True])
def test_padded_prefill_equals_the_prefill_and_writes_only_the_pad_slot(
    engine: Engine, cached: bool
) -> None:
    runner = engine.runner
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 40, (n,), generator=gen).tolist() for n in (9, 23, 5)]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    try:
        prefix = [4, 11, 2] if cached else None
        if cached:  # the cached prefixes' K/V must be there: compute whole prompts first
            runner.forward(prepare_prefill(prompts, slots))
        step = prepare_prefill(prompts, slots, prefix)
        want = runner.forward(step)[_last(step)]
        runner.kv_pool.k_cache[0][KVPool.PAD_SLOT] = 1e4  # a sentinel only pad tokens overwrite
        k_before = runner.kv_pool.k_cache[0].clone()
        padded = pad_prefill(step, 128, 5)
        assert padded.input_ids.numel() == 128 and padded.qo_indptr.numel() == 6
        assert torch.equal(padded.qo_indptr[:4], step.qo_indptr)
        got = runner.forward(padded)[_last(step)]
        torch.testing.assert_close(got, want, atol=ATOL_ROWS, rtol=0)
        # only the real tokens' slots (rewritten with the same K) and the pad slot changed
        changed = (runner.kv_pool.k_cache[0] != k_before).flatten(1).any(dim=1)
        touched = set(changed.nonzero().flatten().tolist())
        assert touched <= set(step.out_cache_loc.tolist()) | {KVPool.PAD_SLOT}, touched
        assert KVPool.PAD_SLOT in touched, "the pad tokens wrote nothing"
    finally:
        for s in slots:
            runner.allocator.free(s)


def test_a_prefill_that_cannot_take_its_pad_is_refused() -> None:
    step = prepare_prefill([[1, 2, 3]], [torch.arange(1, 4)])
    with pytest.raises(ValueError, match="do not pad"):
        pad_prefill(step, 3, 2)


def test_a_default_prefill_chunk_of_up_to_16_requests_replays_the_largest_graph() -> None:
    """The default chunk leaves a token for each pad sequence the shape may need (a chunk of
    9 requests replays 17 sequences), so a full chunk never falls back to an eager forward."""
    from types import SimpleNamespace

    from flashrec_core.engine.prefill_graph import EAGER_CHUNK_TOKENS, prefill_chunk_tokens

    buckets = token_buckets(8192)
    graphs = SimpleNamespace(buckets=buckets)
    chunk = prefill_chunk_tokens(EngineConfig(model_path="m"), graphs)
    assert chunk == 8184
    for requests in range(1, 17):
        assert prefill_shape(chunk, requests, buckets) is not None, requests
    assert prefill_shape(chunk + 1, 9, buckets) is None, "a token more: 9 requests run eagerly"
    assert prefill_chunk_tokens(EngineConfig(model_path="m"), None) == EAGER_CHUNK_TOKENS
    assert prefill_chunk_tokens(EngineConfig(model_path="m", prefill_chunk_tokens=0), graphs) == 0
