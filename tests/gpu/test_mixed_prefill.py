"""Mixed prefills on CUDA, with the kernels the GPU runs (the Triton prefill and beam kernels, the
fused paths): a segmented forward equals its steps' own forwards, and a loop without CUDA graphs
(where `mixed_prefill_steps` applies) carries a wave's beam step in the next wave's prefill and
answers as the requests served alone."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_inputs import prepare_beam_decode
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_same_beams_within

pytestmark = pytest.mark.gpu

ATOL_BF16_ENGINE = 2e-2
"""One bf16 engine, two batch compositions: cuBLAS may sum a projection of another row count in
another order, which can flip the bf16 rounding of an activation (2^-8 relative); that moves a
final-normed hidden state (|h| <= ~4) by up to ~1.6e-2 (tests/core/test_segmented_forward.py)."""
BEAM_TOL = 0.05
"""Per-beam log-prob gap between two such runs of one request: three levels of that noise
(tests/core/test_merged_steps.py)."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The GPU tier's tiny Qwen3 (head_dim 64: FlashInfer, which one-query prefills of a cached
    prompt still take, has no kernels for the CPU tier's 16)."""
    path = tmp_path_factory.mktemp("mixed-gpu")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(path / "c.json", random_codes(400, seed=3))
    cfg = EngineConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", quantization="none",
        kv_cache_dtype="bfloat16", kv_cache_tokens=1 << 14, cuda_graphs=False,
        show_progress=False,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))


def test_the_loop_runs_eagerly_where_mixing_applies(engine: Engine) -> None:
    assert engine.wave.mixes_prefills and engine.loop.mixed_prefill_steps
    assert engine.runner.beam_attention == "triton"


def test_a_segmented_forward_equals_its_steps_alone(engine: Engine) -> None:
    runner = engine.runner
    prompt = [12, 13, 14, 15, 16]
    slots = runner.allocator.alloc(len(prompt))
    runner.forward(prepare_prefill([prompt], [slots]))
    rows = 4
    step = prepare_beam_decode(
        torch.tensor([engine.layout.level_starts[0] + k for k in range(rows)]),
        torch.full((rows,), len(prompt)), slots, torch.tensor([len(prompt)]),
        torch.zeros(rows, dtype=torch.int64), torch.empty(rows, 0, dtype=torch.int64),
        runner.allocator.alloc(rows),
    )  # fmt: skip
    prefill = prepare_prefill([[5, 6, 7, 8, 9, 10, 11]], [runner.allocator.alloc(7)])
    alone = torch.cat([runner.forward(prefill), runner.forward(step)])
    together = runner.forward_segments([prefill, step])
    torch.testing.assert_close(together, alone, atol=ATOL_BF16_ENGINE, rtol=0)


def test_a_prefill_carries_the_step_of_the_wave_in_flight(engine: Engine) -> None:
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="user history w21 w22 w23", n=8))
    loop.run_once()
    before = loop.stats().mixed_forwards
    second = loop.submit(engine.make_request(prompt="w24 w25 w26 w27 next", n=4))
    loop.run_once()
    assert loop.stats().mixed_forwards == before + 1
    while not (first.future.done() and second.future.done()):
        loop.run_once()
    for h in (first, second):
        [alone] = engine.generate([h.request])
        got = {c.codes: c.logprob for c in h.future.result().choices}
        assert_same_beams_within(got, {c.codes: c.logprob for c in alone.choices}, BEAM_TOL)
