"""The benchmark's workload and roofline model (the timed run itself needs CUDA: tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrec_core.bench.roofline import Peaks, ServedModel, floor_seconds, wave_cost
from flashrec_core.bench.workload import (
    RequestSpec,
    load_shape,
    random_catalog,
    sid_layout_at_end,
    synthetic_requests,
)
from flashrec_core.registry import Registry

PEAKS = Peaks(gemm_flops=1e15, copy_bytes=4e12)


def _config():
    shape = load_shape("qwen3-1.7b", None)
    return Registry.discover().resolve(shape["architectures"][0]).parse_config(shape)


def test_preset_comes_from_a_plugin_and_unknown_presets_are_named() -> None:
    assert load_shape("qwen3-1.7b", None)["num_hidden_layers"] == 28
    with pytest.raises(ValueError, match="unknown bench preset 'nope'.*qwen3-1.7b"):
        load_shape("nope", None)


def test_prefill_flops_match_the_parameter_count() -> None:
    cfg = _config()
    cost = wave_cost(cfg, PEAKS, [1024], [1], (8192,), weight_bytes=0, kv_bytes=1, cascade=True)
    h, layers, inter = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)  # ~1.41e9 for this shape
    attention = 4 * q * layers * 1024 * 1025 / 2
    head = 2 * 8192 * h
    assert cost.flops == pytest.approx(2 * params * 1024 + attention + head)


def test_cascade_reads_each_prompt_once_per_request() -> None:
    cfg, args = _config(), ([1024] * 4, [64] * 4, (8192, 8192, 8192), 1.7e9, 1)
    flat = wave_cost(cfg, PEAKS, *args, cascade=False)
    cascade = wave_cost(cfg, PEAKS, *args, cascade=True)
    kv_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
    # 2 decode steps, each reading 4 prompts x 1024 tokens x 63 extra beams less with cascade
    assert flat.bytes - cascade.bytes == pytest.approx(2 * 4 * 1024 * 63 * kv_per_token)
    assert cascade.floor_seconds < flat.floor_seconds


def test_the_floor_of_requests_packs_them_into_waves_like_the_engine() -> None:
    """Every path's floor (Engine.generate, the server) packs the same requests the same way:
    over the row budget they become several waves, each reading the weights again."""
    cfg, levels = _config(), (8192, 8192, 8192)
    requests = [(16, 32)] * 8  # 256 beam rows, short prompts: every forward is weight-bound
    served = ServedModel(weight_bytes=1.7e9, kv_bytes=1, cascade=True, fp8=True,
                         max_wave_rows=128, max_requests=1024, kv_slots=1 << 20)  # fmt: skip
    split = floor_seconds(cfg, served, PEAKS, requests, levels)
    half = wave_cost(cfg, PEAKS, [16] * 4, [32] * 4, levels, 1.7e9, 1, True).floor_seconds
    assert split == pytest.approx(2 * half)
    one = floor_seconds(cfg, ServedModel(**{**served.__dict__, "max_wave_rows": 256}), PEAKS,
                        requests, levels)  # fmt: skip
    whole = wave_cost(cfg, PEAKS, [16] * 8, [32] * 8, levels, 1.7e9, 1, True).floor_seconds
    assert one == pytest.approx(whole) and one < split


def test_the_server_floor_is_the_engine_floor_of_its_prompts_and_reports_its_peaks() -> None:
    """`flashrec bench --server` prices the prompts it sent as `Engine.generate`'s bench does,
    and its output carries the peaks beside the floor, under the synthetic bench's names."""
    from flashrec_core.bench.load import ServerFloor

    cfg, levels = _config(), (8192, 8192, 8192)
    served = ServedModel(weight_bytes=1.7e9, kv_bytes=1, cascade=True, fp8=True,
                         max_wave_rows=128, max_requests=1024, kv_slots=1 << 20)  # fmt: skip
    floor = ServerFloor(cfg, served, PEAKS, 32, levels)
    prompts = [[7] * 16] * 3 + [[7] * 40] * 5
    want = floor_seconds(cfg, served, PEAKS, [(16, 32)] * 3 + [(40, 32)] * 5, levels)
    assert floor(prompts) == pytest.approx(want) and want > 0
    assert floor.peaks.fields() == pytest.approx(
        {"peak_gemm_tflops": PEAKS.gemm_flops / 1e12, "peak_copy_tb_per_s": PEAKS.copy_bytes / 1e12}
    )


def test_synthetic_catalog_and_requests() -> None:
    codes = random_catalog((64, 64, 64), 5000, seed=1)
    assert codes.shape == (5000, 3) and len(np.unique(codes, axis=0)) == 5000
    assert np.all(np.diff(codes[:, 0]) >= 0), "sorted like Catalog.codes"
    layout = sid_layout_at_end(1000 + 3 * 64 + 2, (64, 64, 64))
    reqs = synthetic_requests(RequestSpec(3, 100, 16, 8), layout)
    assert all(len(r.prompt_ids) == 100 and r.prompt_ids[-1] == layout.begin_token_id for r in reqs)
    assert len({r.prompt_ids[:16] for r in reqs}) == 1 and len({r.prompt_ids for r in reqs}) == 3
    assert max(max(r.prompt_ids[:-1]) for r in reqs) < layout.sid_start


def test_result_check_counts_beams_off_the_catalog() -> None:
    from flashrec_core.bench.run import _check_results
    from flashrec_core.engine.beam_wave import WaveOutput
    from flashrec_core.search.beam import BeamLayout

    catalog = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    out = WaveOutput(
        BeamLayout.create([4], torch.device("cpu")),
        codes=torch.tensor([[3, 4, 5], [0, 1, 2], [6, 7, 0], [0, 0, 0]]),
        scores=torch.tensor([-1.0, -2.0, -3.0, float("-inf")]),
        nodes=torch.tensor([1, 0, 2, 0]),
        path_scores=torch.tensor([[-1.0] * 3, [-2.0] * 3, [-3.0] * 3, [float("-inf")] * 3]),
    )
    assert _check_results([out], catalog) == {"invalid_sids": 1, "dead_beams": 1}


def test_random_model_builds_a_runner_on_cpu() -> None:
    """The bench's model path resolves every "auto" (beam_attention included) before the runner."""
    from flashrec_core.bench.workload import random_model
    from flashrec_core.config import EngineConfig
    from flashrec_core.engine.model_runner import ModelRunner

    shape = load_shape("qwen3-small", None)
    shape = {**shape, "num_hidden_layers": 1}
    cfg = EngineConfig(model_path="<random>", device="cpu", kv_cache_tokens=256, max_requests=4)
    runner = ModelRunner(random_model(shape, cfg))
    assert (
        runner.beam_attention == "cascade" and runner.loaded.engine_config.triton_kernels is False
    )


def test_a_shared_prefix_as_long_as_the_prompt_is_refused_with_both_flags_named() -> None:
    with pytest.raises(ValueError, match="--shared-prefix 64 .* --prompt-len 64"):
        RequestSpec(3, 64, 64, 8)
