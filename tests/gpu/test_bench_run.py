"""`flashrec bench` end to end on CUDA with a small shape (the real figures: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from flashrec_core.bench.run import BenchConfig, run_bench

pytestmark = pytest.mark.gpu


def test_bench_reports_every_field() -> None:
    bc = BenchConfig(
        preset="qwen3-small", prompt_len=128, shared_prefix=16, n=8, num_requests=24,
        catalog_size=5000, level_sizes=(256, 256, 256), rows_per_wave=64, hf_requests=2, hf_batch=2,
    )  # fmt: skip
    result = run_bench(bc)
    assert result["waves"] == 3 and len(result["wave_end_ms"]) == 3
    assert result["requests_per_s"] > 0 and result["hf_requests_per_s"] > 0
    assert 0 < result["percent_of_roofline"] < 100
    assert result["invalid_sids"] == 0 and result["dead_beams"] == 0
    # every measured beam step replays a graph captured during warm-up
    assert result["eager_steps"] == 0 and result["graph_replays"] == 6


def test_bench_without_graphs_counts_eager_steps() -> None:
    bc = BenchConfig(
        preset="qwen3-small", prompt_len=64, shared_prefix=16, n=4, num_requests=8,
        catalog_size=2000, level_sizes=(256, 256, 256), rows_per_wave=16, graphs=False,
        hf_baseline=False,
    )  # fmt: skip
    result = run_bench(bc)
    assert result["graph_replays"] == 0 and result["eager_steps"] == 2 * result["waves"]
