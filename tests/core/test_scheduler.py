"""Packing requests into waves, and the engine returning the same results whatever the packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.engine.scheduler import plan_waves
from flashrec_core.kvcache import OutOfSlotsError
from flashrec_core.testing.checkpoint import write_tiny_checkpoint


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


def test_engine_results_do_not_depend_on_wave_packing(tmp_path: Path) -> None:
    from flashrec_models_qwen3 import spec

    write_tiny_checkpoint(tmp_path, spec.examples[0].hf_config, level_sizes=(16, 16, 16))
    catalog = {f"{a},{b},{(a + b) % 16}": f"i{a}-{b}" for a in range(16) for b in range(16)}
    (tmp_path / "c.json").write_text(json.dumps(catalog))

    def engine(rows: int) -> Engine:
        cfg = EngineConfig(model_path=str(tmp_path), device="cpu", max_wave_rows=rows,
                           kv_cache_tokens=1 << 14, show_progress=False)  # fmt: skip
        return Engine.from_config(cfg, SearchConfig(catalog_path=str(tmp_path / "c.json")))

    prompts = [f"user w{i} w{i + 3} item w{i % 7}" for i in range(40)]
    wide, narrow = engine(4096), engine(12)
    a = wide.generate([wide.make_request(prompt=p, n=1 + i % 8) for i, p in enumerate(prompts)])
    b = narrow.generate([narrow.make_request(prompt=p, n=1 + i % 8) for i, p in enumerate(prompts)])
    assert len(a) == len(b) == 40
    for x, y in zip(a, b):
        assert [c.codes for c in x.choices] == [c.codes for c in y.choices]
        assert all(abs(c.logprob - d.logprob) < 1e-5 for c, d in zip(x.choices, y.choices))
