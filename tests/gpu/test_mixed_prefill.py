"""Mixed prefills on CUDA, with the kernels the GPU runs (the Triton prefill and beam kernels, the
fused paths): a segmented forward equals its steps' own forwards; a loop without CUDA graphs, and
one with them (through graphs of mixed steps, `DecodeGraphs.run_mixed`), carries a wave's beam
step in the next wave's prefill and answers as the requests served alone; a mixed replay equals
the work it recorded, run eagerly on the same buffers, bit for bit."""

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


def _engine(
    tmp_path_factory: pytest.TempPathFactory, cuda_graphs: bool, mixed_prefill_tokens: int = 0
) -> Engine:
    """The GPU tier's tiny Qwen3 (head_dim 64: FlashInfer, which one-query prefills of a cached
    prompt still take, has no kernels for the CPU tier's 16)."""
    path = tmp_path_factory.mktemp("mixed-gpu")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(path / "c.json", random_codes(400, seed=3))
    cfg = EngineConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", quantization="none",
        kv_cache_dtype="bfloat16", kv_cache_tokens=1 << 14, cuda_graphs=cuda_graphs,
        mixed_prefill_tokens=mixed_prefill_tokens, show_progress=False,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _engine(tmp_path_factory, cuda_graphs=False)


@pytest.fixture(scope="module")
def graph_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """With mixed graphs (off by default with CUDA graphs: `mixed_prefill_tokens`)."""
    return _engine(tmp_path_factory, cuda_graphs=True, mixed_prefill_tokens=2048)


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


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_prefill_carries_the_step_of_the_wave_in_flight(
    engine: Engine, graph_engine: Engine, graphs: bool
) -> None:
    engine = graph_engine if graphs else engine
    assert engine.wave.mixes_prefills and (engine.wave.graphs is not None) == graphs
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="user history w21 w22 w23", n=8))
    loop.run_once()
    before = loop.stats().mixed_forwards
    replays = engine.wave.graphs.stats.mixed_replays if graphs else 0
    second = loop.submit(engine.make_request(prompt="w24 w25 w26 w27 next", n=4))
    loop.run_once()
    assert loop.stats().mixed_forwards == before + 1
    if graphs:
        assert engine.wave.graphs.stats.mixed_replays == replays + 1
    while not (first.future.done() and second.future.done()):
        loop.run_once()
    for h in (first, second):
        [alone] = engine.generate([h.request])
        got = {c.codes: c.logprob for c in h.future.result().choices}
        assert_same_beams_within(got, {c.codes: c.logprob for c in alone.choices}, BEAM_TOL)


def test_a_mixed_replay_equals_its_recorded_work(graph_engine: Engine) -> None:
    """`run_mixed` by replay, then the same inputs through the captured work run eagerly on the
    same buffers and plans (replay=False): the prompts' hidden states and the wave's selection
    bit for bit."""
    from flashrec_core.engine.cuda_graph import MergedPart

    engine = graph_engine
    wave, loop, runner = engine.wave, engine.loop, engine.runner
    handle = loop.submit(engine.make_request(prompt="w31 w32 w33", n=4))
    loop.run_once()
    [state] = [w.state for w in loop._waves]
    part = wave._step_parts(state, pad=True)
    merged = [MergedPart(state.level, part.step, part.sel.score, part.sel.node, part.beams)]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    prefill = prepare_prefill(prompts, slots)
    last = (prefill.qo_indptr[1:] - 1).cuda()
    graphs = wave.graphs
    outs = [
        graphs.run_mixed(prefill, last, merged, wave.depth - 1, state.variant, replay=replay)
        for replay in (True, False)
    ]  # fmt: skip
    assert outs[0] is not None and outs[1] is not None
    (replayed_hidden, [replayed]), (eager_hidden, [eager]) = outs
    assert torch.equal(replayed_hidden, eager_hidden)
    for name in ("parent", "code", "node", "score"):
        assert torch.equal(getattr(replayed, name), getattr(eager, name)), name
    for s in slots:
        runner.allocator.free(s)
    while not handle.future.done():
        loop.run_once()


def test_the_warm_up_captures_mixed_graphs_once(graph_engine: Engine) -> None:
    wave = graph_engine.wave
    captured = wave.capture_mixed_steps(4)
    assert captured > 0 and wave.graphs.stats.captures >= captured
    assert wave.capture_mixed_steps(4) == 0, "every shape is captured already"
