"""Packing requests into waves, and the engine returning the same results whatever the packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.engine.scheduler import plan_waves, prefill_chunks
from flashrec_core.kvcache import OutOfSlotsError
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_same_ranking


def _req(prompt_len: int, n: int) -> GenerationRequest:
    return GenerationRequest(tuple(range(1, prompt_len + 1)), n)


def test_waves_respect_rows_requests_and_kv_slots() -> None:
    reqs = [_req(10, 8), _req(10, 8), _req(10, 4), _req(10, 16), _req(10, 1)]
    assert plan_waves(reqs, depth=3, max_rows=16, max_requests=8, kv_slots=10_000) == [
        [0, 1], [2], [3], [4],
    ]  # fmt: skip
    assert plan_waves(reqs, depth=3, max_rows=64, max_requests=2, kv_slots=10_000) == [
        [0, 1], [2, 3], [4],
    ]  # fmt: skip
    # each request needs 10 + n * 2 slots: 26, 26, 18, 42, 12
    assert plan_waves(reqs, depth=3, max_rows=64, max_requests=8, kv_slots=60) == [
        [0, 1], [2, 3], [4],
    ]  # fmt: skip


def test_a_request_that_can_never_fit_is_named() -> None:
    with pytest.raises(OutOfSlotsError, match="request 1 needs 32 beam rows"):
        plan_waves([_req(4, 2), _req(4, 32)], depth=3, max_rows=16, max_requests=8, kv_slots=999)


def test_prefill_chunks_fill_each_forward_and_split_prompts_in_order() -> None:
    assert prefill_chunks([10, 10, 10], [0, 2, 0], 8) == [
        [(0, 0, 8)], [(0, 8, 10), (1, 2, 8)], [(1, 8, 10), (2, 0, 6)], [(2, 6, 10)],
    ]  # fmt: skip
    assert prefill_chunks([4, 4], [0, 0], 8) == [[(0, 0, 4), (1, 0, 4)]], "exactly full"
    assert prefill_chunks([7, 7, 7], [1, 0, 3], 0) == [[(0, 1, 7), (1, 0, 7), (2, 3, 7)]]
    assert prefill_chunks([], [], 64) == []


def _tiny_engine_dir(tmp_path: Path) -> Path:
    from flashrec_models_qwen3 import spec

    write_tiny_checkpoint(tmp_path, spec.examples[0].hf_config, level_sizes=(16, 16, 16))
    catalog = {f"{a},{b},{(a + b) % 16}": f"i{a}-{b}" for a in range(16) for b in range(16)}
    (tmp_path / "c.json").write_text(json.dumps(catalog))
    return tmp_path


def _engine(path: Path, rows: int = 4096, chunk: int | None = None) -> Engine:
    cfg = EngineConfig(model_path=str(path), device="cpu", max_wave_rows=rows,
                       kv_cache_tokens=1 << 14, prefill_chunk_tokens=chunk,
                       show_progress=False)  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "c.json")))


def test_a_chunked_prefill_ranks_like_one_forward(tmp_path: Path) -> None:
    """Prompts of 6-9 tokens in forwards of at most 5 new tokens (most prompts split across
    two or three) against one forward per wave: the same beams; log-probs within 1e-5 (one fp32
    engine, two batch compositions of its GEMMs)."""
    path = _tiny_engine_dir(tmp_path)
    prompts = [f"user w{i} w{i + 3} item w{i % 7}" for i in range(12)]
    whole, chunked = _engine(path, chunk=0), _engine(path, chunk=5)
    forwards = []
    real = chunked.wave._prefill_forward
    chunked.wave._prefill_forward = lambda step, seqs: forwards.append(step) or real(step, seqs)
    a = whole.generate([whole.make_request(prompt=p, n=4) for p in prompts])
    b = chunked.generate([chunked.make_request(prompt=p, n=4) for p in prompts])
    sizes = [s.input_ids.numel() for s in forwards]
    assert len(sizes) > len(prompts) and max(sizes) == 5, sizes
    for x, y in zip(a, b, strict=True):
        rank = [[(c.codes, c.logprob) for c in r.choices] for r in (x, y)]
        assert_same_ranking(rank[1], rank[0], 1e-5)


def test_engine_results_do_not_depend_on_wave_packing(tmp_path: Path) -> None:
    path = _tiny_engine_dir(tmp_path)
    prompts = [f"user w{i} w{i + 3} item w{i % 7}" for i in range(40)]
    wide, narrow = _engine(path, rows=4096), _engine(path, rows=12)
    a = wide.generate([wide.make_request(prompt=p, n=1 + i % 8) for i, p in enumerate(prompts)])
    b = narrow.generate([narrow.make_request(prompt=p, n=1 + i % 8) for i, p in enumerate(prompts)])
    assert len(a) == len(b) == 40
    for x, y in zip(a, b):
        assert [c.codes for c in x.choices] == [c.codes for c in y.choices]
        assert all(abs(c.logprob - d.logprob) < 1e-5 for c, d in zip(x.choices, y.choices))
