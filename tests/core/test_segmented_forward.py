"""One model forward over several steps of different kinds (a prompt's prefill, then the beam
steps of waves at two levels; attention/segments.py) gives each step's hidden states as its own
forward does, and writes the same KV."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.attention.triton_beam import TritonBeamAttention
from flashrec_core.attention.triton_prefill import TritonPrefillAttention
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_inputs import concat_beam_steps, prepare_beam_decode
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import ModelRunner, StepInput, prepare_prefill

ATOL_SAME_ENGINE = 1e-5
"""One fp32 engine, two batch compositions: the projections' sums run over other row blocks
(test_engine_loop.py), every other operation is the same per row."""
ATOL_BF16_ENGINE = 2e-2
"""The same in bf16: another row blocking may flip the bf16 rounding of an activation, 2^-8
relative, which moves a final-normed hidden state (|h| <= ~4) by up to ~1.6e-2. (On the
project's CPU machine the two agreed exactly.)"""


@pytest.fixture(scope="module", params=["backend", "fresh"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The torch path, prefills through the backend or over their own K/V (`fresh`: the
    segment's slice of the layer's K/V reaches the prefill)."""
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("segments") / "ckpt"
    write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=800, seed=1)
    cfg = EngineConfig(
        model_path=str(path), device="cpu", kv_cache_tokens=4096, show_progress=False,
        prefill_attention=request.param,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "catalog.json")))


def _prefilled(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Slots of a prompt whose KV is in the pool."""
    slots = runner.allocator.alloc(len(prompt))
    runner.forward(prepare_prefill([prompt], [slots]))
    return slots


def _beam_step(
    runner: ModelRunner, tokens: list[int], prompt_slots: list[torch.Tensor], level: int
) -> StepInput:
    """A level-`level` beam step of one wave: each request's rows after its prompt, with
    level - 1 ancestors' slots (written by an earlier step) and one own slot."""
    widths = [len(tokens) // len(prompt_slots)] * len(prompt_slots)
    rows = sum(widths)
    row_request = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
    lens = torch.tensor([s.numel() for s in prompt_slots])
    history = runner.allocator.alloc(rows * (level - 1)).view(rows, level - 1)
    if level > 1:  # the ancestors' KV: one earlier step of the same rows
        first = prepare_beam_decode(
            torch.tensor(tokens), lens[row_request], torch.cat(prompt_slots), lens, row_request,
            history[:, :0], history[:, 0],
        )  # fmt: skip
        runner.forward(first)
    return prepare_beam_decode(
        torch.tensor(tokens), lens[row_request] + level - 1, torch.cat(prompt_slots), lens,
        row_request, history, runner.allocator.alloc(rows),
    )  # fmt: skip


def test_a_prefill_and_beam_steps_in_one_forward_equal_their_own_forwards(engine: Engine) -> None:
    runner = engine.runner
    starts = engine.layout.level_starts
    a, b, c = [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19]
    b_slots, c_slots = _prefilled(runner, b), _prefilled(runner, c)
    level1 = _beam_step(runner, [starts[0] + k for k in (1, 4, 9)], [b_slots], level=1)
    level2 = _beam_step(runner, [starts[1] + k for k in (0, 2, 3, 5)], [b_slots, c_slots], level=2)
    # the prompt continues b, whose KV is cached: a prefill with context
    a_slots = torch.cat([b_slots, runner.allocator.alloc(len(a))])
    steps = [prepare_prefill([b + a], [a_slots], [len(b)]),
             concat_beam_steps([level1, level2])]  # fmt: skip
    alone = [runner.forward(step) for step in steps]
    slots = torch.cat([s.out_cache_loc for s in steps])
    caches = [*runner.kv_pool.k_cache, *runner.kv_pool.v_cache]  # every layer's K, then V
    kv_alone = [cache[slots].clone() for cache in caches]
    for cache in caches:  # the segmented forward must write them again
        cache[slots] = 0

    together = runner.forward_segments(steps)

    assert together.shape[0] == sum(h.shape[0] for h in alone)
    torch.testing.assert_close(together, torch.cat(alone), atol=ATOL_SAME_ENGINE, rtol=0)
    for cache, kv in zip(caches, kv_alone):
        torch.testing.assert_close(cache[slots], kv, atol=ATOL_SAME_ENGINE, rtol=0)


def test_a_segmented_forward_needs_a_step(engine: Engine) -> None:
    with pytest.raises(ValueError, match="at least one step"):
        engine.runner.forward_segments([])


def test_one_segment_is_the_plain_forward(engine: Engine) -> None:
    runner = engine.runner
    step = prepare_prefill([[3, 4, 5, 6]], [runner.allocator.alloc(4)])
    torch.testing.assert_close(runner.forward_segments([step]), runner.forward(step),
                               atol=0, rtol=0)  # fmt: skip


@pytest.fixture(scope="module")
def kernel_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The GPU's attention path in the Triton interpreter: prefills through the prefill
    kernel, beam steps through the beam kernel, in bf16 (the kernels' dtype)."""
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("segments-kernels") / "ckpt"
    write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=800, seed=1)
    cfg = EngineConfig(
        model_path=str(path), device="cpu", dtype="bfloat16", kv_cache_tokens=4096,
        show_progress=False, prefill_attention="triton", beam_attention="triton",
        triton_on_cpu=True,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "catalog.json")))


def test_segments_through_the_triton_kernels(kernel_engine: Engine) -> None:
    runner = kernel_engine.runner
    backend = runner.attn_backend
    assert isinstance(backend, TritonPrefillAttention)
    assert isinstance(backend.inner, TritonBeamAttention)
    starts = kernel_engine.layout.level_starts
    b_slots = _prefilled(runner, [12, 13, 14, 15, 16])
    step = _beam_step(runner, [starts[1] + k for k in (0, 2, 3, 5)], [b_slots], level=2)
    prefill = prepare_prefill([[5, 6, 7, 8, 9, 10, 11]], [runner.allocator.alloc(7)])
    alone = torch.cat([runner.forward(prefill), runner.forward(step)])
    together = runner.forward_segments([prefill, step])
    torch.testing.assert_close(together, alone, atol=ATOL_BF16_ENGINE, rtol=0)
