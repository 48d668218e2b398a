"""Graphs of mixed steps (engine/cuda_graph.py `run_mixed`): an admitted wave's prefill and the
beam steps of the waves in flight in one captured forward. The capture needs CUDA
(tests/gpu/test_mixed_prefill.py); here, the shapes a prefill rides in, and what a mixed graph
records, run eagerly on the CPU through the engine's backend stack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.engine.beam_inputs import concat_beam_steps
from flashrec_core.engine.prefill_graph import (
    mixed_prefill_shape,
    mixed_token_buckets,
    pad_prefill,
)
from tests.core.test_engine_loop import assert_idle
from tests.core.test_engine_loop import checkpoint as checkpoint  # noqa: F401 (fixture)
from tests.core.test_merged_steps import _graph_stack_engine, assert_each_wave_selects_on_its_rows


def test_mixed_buckets_start_where_a_forward_stops_being_bound_by_its_weights() -> None:
    assert mixed_token_buckets(2048) == [512, 1024, 2048]
    assert mixed_token_buckets(1500) == [512, 1024, 1500]
    assert mixed_token_buckets(300) == [300]  # a setting below 512 is its own bucket
    assert mixed_token_buckets(0) == []


@pytest.mark.parametrize(
    ("tokens", "requests", "most", "shape"),
    [
        (960, 1, 2048, (1024, 3)),  # one 1,024-token prompt after a 64-token cached prefix
        (1920, 2, 2048, (2048, 3)),  # two of them
        (1022, 1, 2048, (1024, 3)),  # the last token that leaves room for two pad sequences
        (1023, 1, 2048, (2048, 3)),
        (100, 1, 2048, (512, 3)),  # short prompts pad to the smallest bucket
        (2047, 1, 2048, None),  # no room for the pad sequences: apart
        (300, 3, 2048, None),  # three requests: apart
        (100, 1, 0, None),  # mixing off
    ],
)  # fmt: skip
def test_a_prefill_rides_in_the_smallest_mixed_shape_that_holds_it(
    tokens: int, requests: int, most: int, shape: tuple[int, int] | None
) -> None:
    assert mixed_prefill_shape(tokens, requests, most) == shape


def test_a_mixed_graphs_work_equals_the_segmented_forward_it_records(checkpoint: Path) -> None:
    """What a mixed graph records, run eagerly (`run_mixed` with replay=False): the prefill of
    two new prompts padded to its mixed shape, then two real waves in flight (levels 2 and 1),
    planned into the graph buffers (the prefill's into the Triton prefill wrapper's, the steps'
    into the beam wrapper's, own slots widened to depth - 1). It must equal the same padded
    prefill and steps through `forward_segments` with eager plans, then each wave's own
    selection, exactly: the same rows and kernels, so a wrong offset between the prefill's
    tokens and the step rows, a wrong plan per segment or a wrong last-token row shows."""
    pytest.importorskip("triton")
    from flashrec_core.engine.cuda_graph import DecodeGraphs, MergedPart
    from flashrec_core.engine.model_runner import prepare_prefill

    engine = _graph_stack_engine(checkpoint)
    wave, loop, runner = engine.wave, engine.loop, engine.runner
    handles = []
    for prompt in ("w1 w2 w3", "w4 w5"):
        handles.append(loop.submit(engine.make_request(prompt=prompt, n=4)))
        loop.run_once()
    states = [w.state for w in loop._waves]
    assert [s.level for s in states] == [2, 1], "one wave per level in flight"
    parts = [wave._step_parts(s, pad=False) for s in states]
    merged = [
        MergedPart(s.level, p.step, p.sel.score, p.sel.node, p.beams, s.masks)
        for s, p in zip(states, parts)
    ]  # fmt: skip
    prompts = [list(engine.make_request(prompt=p, n=4).prompt_ids) for p in ("w6 w7 w8", "w9")]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    prefill = prepare_prefill(prompts, slots)
    last = prefill.qo_indptr[1:] - 1
    graphs = DecodeGraphs(runner, wave.selector, wave.trie, wave.max_rows, mixed_tokens=1024)
    variant = states[0].variant
    out = graphs.run_mixed(prefill, last, merged, wave.depth - 1, variant, replay=False)
    assert out is not None
    got_hidden, got = out

    shape = mixed_prefill_shape(prefill.input_ids.numel(), len(prompts), 1024)
    assert shape == (512, 3)
    padded = pad_prefill(prefill, *shape)
    hidden = runner.forward_segments([padded, concat_beam_steps([p.step for p in parts])])
    assert torch.equal(got_hidden, hidden[last]), "the prompts' last hidden states"
    assert_each_wave_selects_on_its_rows(wave, states, parts, got, hidden, shape[0])
    for s in slots:
        runner.allocator.free(s)
    while not all(h.future.done() for h in handles):  # the waves finish; nothing leaks
        loop.run_once()
    assert_idle(engine)
