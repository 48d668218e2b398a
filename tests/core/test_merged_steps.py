"""Merged beam steps (EngineConfig.merge_beam_steps): the waves in flight, at different levels,
share one model forward per loop iteration. The merged step's attention equals each part's on
its own (torch backend, Triton beam kernel, sliding windows), and the engine's answers equal the
same requests served alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.attention import TorchAttentionBackend, window_shared_prefix
from flashrec_core.attention.step import dense_suffix
from flashrec_core.attention.triton_beam import TritonBeamAttention
from flashrec_core.engine.beam_inputs import concat_beam_steps, prepare_beam_decode
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch
from flashrec_core.spec import AttentionSpec
from flashrec_core.testing.hf_beam import assert_same_ranking
from tests.core.test_engine_loop import assert_idle, make_engine, ranking

CPU = torch.device("cpu")
HQ, HKV, D = 4, 2, 32
ATOL_SAME_ENGINE = 1e-5  # one fp32 engine, two batch compositions (test_engine_loop.py)
# The Triton kernel against the torch backend: the same fp32 softmax over the same slots, the
# kernel's output rounded to bf16 (2^-9 relative on |v| <= ~3) and summed in another order.
ATOL_KERNEL = 2e-2
BEAM_TOL = 0.05
"""Per-beam log-prob gap between two BF16 engines whose attention differs by bf16 rounding: three
steps of ~1e-2 attention noise (test_triton_beam_attention.py)."""


def _wave_step(gen: torch.Generator, widths: list[int], prompt_lens: list[int], level: int,
               first_slot: int):  # fmt: skip
    """A beam step of one wave at `level`: its rows have level - 1 ancestors' slots + one own."""
    rows = sum(widths)
    row_request = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
    return prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64),
        positions=torch.zeros(rows, dtype=torch.int64),
        prompts=torch.randint(1, 100, (sum(prompt_lens),), generator=gen),
        prompt_lens=torch.tensor(prompt_lens), row_request=row_request,
        history=torch.randint(100, 200, (rows, level - 1), generator=gen),
        own=torch.arange(first_slot, first_slot + rows),
    )  # fmt: skip


def _steps_and_pool():
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, HKV, D, 300, torch.bfloat16, CPU)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, generator=gen).bfloat16())
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, generator=gen).bfloat16())
    parts = [
        _wave_step(gen, [3, 2], [7, 12], level=1, first_slot=200),
        _wave_step(gen, [4], [9], level=2, first_slot=210),
        _wave_step(gen, [1, 2], [5, 3], level=3, first_slot=220),
    ]
    return pool, parts, gen


def _attend(backend, step, pool, q: torch.Tensor, scale: float = D**-0.5) -> torch.Tensor:
    meta = backend.plan(step)
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, backend, meta)
    return backend.forward(q, 0, scale, batch).float()


def test_concat_keeps_each_rows_request_prompt_and_own_slots() -> None:
    _, parts, _ = _steps_and_pool()
    merged = concat_beam_steps(parts)
    sp = merged.shared_prefix
    assert sp.prefix_qo_indptr.tolist() == [0, 3, 5, 9, 10, 12]
    assert sp.prefix_kv_indptr.tolist() == [0, 7, 19, 28, 33, 36]
    assert (sp.suffix_kv_indptr[1:] - sp.suffix_kv_indptr[:-1]).tolist() == [1] * 5 + [2] * 4 + [
        3
    ] * 3
    assert merged.kv_indptr.tolist()[-1] == sum(int(p.kv_indptr[-1]) for p in parts)
    dense = dense_suffix(sp, 3)
    assert dense[:5, 1:].eq(-1).all() and dense[5:9, 2:].eq(-1).all() and dense[9:].ge(0).all()
    assert dense[:5, 0].tolist() == list(range(200, 205)), "level 1: its own slot only"
    assert concat_beam_steps(parts[:1]) is parts[0]


@pytest.mark.parametrize(
    "spec",
    [AttentionSpec(scale=D**-0.5), AttentionSpec(scale=D**-0.5, sliding_window=6)],
    ids=["full", "window"],
)
def test_merged_attention_equals_each_part_alone(spec: AttentionSpec) -> None:
    """Torch backend: rows of waves at levels 1-3 in one step attend exactly as in their own
    step (a window cuts each request's prompt by its own rows' slot count); the Triton kernel
    (interpreted) over the merged step matches within its bf16 rounding."""
    pool, parts, gen = _steps_and_pool()
    merged = concat_beam_steps(parts)
    rows = merged.input_ids.numel()
    q = torch.randn(rows, HQ, D, generator=gen).bfloat16()
    torch_backend = TorchAttentionBackend(CPU, layers=(spec,))
    together = _attend(torch_backend, merged, pool, q.float(), spec.scale)
    alone, start = [], 0
    for part in parts:
        n = part.input_ids.numel()
        alone.append(_attend(torch_backend, part, pool, q[start : start + n].float(), spec.scale))
        start += n
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-6, atol=1e-6)
    pytest.importorskip("triton")
    triton = TritonBeamAttention(
        torch_backend, CPU, max_rows=64, max_prompt_slots=256, layers=(spec,), head_dim=D
    )
    got = _attend(triton, merged, pool, q, spec.scale)
    assert (got - together).abs().max().item() < ATOL_KERNEL


def test_window_cut_follows_each_requests_own_slots() -> None:
    _, parts, _ = _steps_and_pool()
    cut = window_shared_prefix(concat_beam_steps(parts).shared_prefix, 6)
    # prompts 7, 12, 9, 5, 3 with 1, 1, 2, 3, 3 own slots: keep 6 - own of each, at most all
    assert (cut.prefix_kv_indptr[1:] - cut.prefix_kv_indptr[:-1]).tolist() == [5, 5, 4, 3, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("merged") / "ckpt"
    write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=800, seed=1)
    return path


def test_waves_in_flight_share_a_forward_and_answer_as_alone(checkpoint: Path) -> None:
    """Requests joining every iteration (mixed n, one sampled with a seed): the waves at levels
    1 and 2 step through one forward, and every answer equals the same request served alone by
    an engine that never merges."""
    merged = make_engine(checkpoint, merge_beam_steps=True)
    alone = make_engine(checkpoint)
    specs = [
        dict(prompt="w1 w2 w3", n=8),
        dict(prompt="w4 w5", n=4),
        dict(prompt="w6 w7 w8 w9", n=8, temperature=0.7, seed=3),
        dict(prompt="w2 w9", n=16),
        dict(prompt="w5 w1 w3", n=4),
    ]
    loop, handles = merged.loop, []
    for spec in specs:  # one admission per iteration: waves at different levels in flight
        handles.append(loop.submit(merged.make_request(**spec)))
        loop.run_once()
    while not all(h.future.done() for h in handles):
        loop.run_once()
    stats = loop.stats()
    assert stats.beam_steps == 2 * len(specs), "each wave took depth - 1 = 2 beam steps"
    assert stats.beam_forwards < stats.beam_steps, "no two waves shared a forward"
    for spec, h in zip(specs, handles):
        [ref] = alone.generate([alone.make_request(**spec)])
        assert_same_ranking(ranking(h.future.result()), ranking(ref), ATOL_SAME_ENGINE)
    assert_idle(merged)
    assert alone.loop.stats().beam_forwards == alone.loop.stats().beam_steps


def test_step_groups_fit_the_beam_row_budget(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, merge_beam_steps=True)  # max_wave_rows 64
    wave = engine.loop.wave
    states = [_rows_state(n) for n in (32, 16, 16, 40, 8, 64)]
    assert wave.step_groups(states) == [[0, 1, 2], [3, 4], [5]]
    wave.merge_steps = False
    assert wave.step_groups(states) == [[i] for i in range(6)]


def _rows_state(n: int):
    """A stand-in wave state with one request of width n (step_groups reads only widths)."""
    from types import SimpleNamespace

    return SimpleNamespace(requests=[SimpleNamespace(n=n)])


def test_a_failed_merged_step_fails_its_waves_and_frees_them(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(checkpoint, merge_beam_steps=True)
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="w1 w2", n=4))
    loop.run_once()
    second = loop.submit(engine.make_request(prompt="w3 w4", n=4))
    loop.run_once()  # both in flight now; the next iteration steps them together
    runner = loop.wave.runner

    def broken(step):
        raise RuntimeError("injected device error")

    monkeypatch.setattr(runner, "forward", broken)
    loop.run_once()
    for h in (first, second):
        with pytest.raises(RuntimeError, match="injected"):
            h.future.result(timeout=0)
    monkeypatch.undo()
    assert_idle(engine)
    [again] = engine.generate([engine.make_request(prompt="w1 w2", n=4)])
    assert len(again.choices) == 4, "the engine serves on after the failed step"


def test_merged_steps_through_the_triton_kernel_match_separate_steps(checkpoint: Path) -> None:
    """The engine (BF16 on CPU) with the Triton beam kernel interpreted and merged steps, whose
    own slots reach the kernel padded with -1, against the same kernel stepping each wave
    alone: the same beams up to the bf16 rounding of GEMMs over other row counts (bounded by
    the kernel-vs-torch bound of test_triton_beam_attention.py, which is far larger). The
    reference is the same kernel, not the torch backend: their ~1e-2 attention noise can move
    a beam across an early level's cut, and then the searches differ by more than noise."""
    pytest.importorskip("triton")
    from flashrec_core.testing.hf_beam import assert_same_beams_within

    bf16 = dict(dtype="bfloat16", enable_fused_rms_fp8=False, enable_fused_silu_fp8=False,
                enable_fused_qk_rope_kv=False)  # fmt: skip
    merged = make_engine(
        checkpoint, beam_attention="triton", triton_on_cpu=True, merge_beam_steps=True, **bf16
    )
    separate = make_engine(checkpoint, beam_attention="triton", triton_on_cpu=True, **bf16)
    specs = [dict(prompt="w1 w2 w3", n=6), dict(prompt="w4 w5", n=6), dict(prompt="w9 w2", n=6)]
    loop, handles = merged.loop, []
    for spec in specs:
        handles.append(loop.submit(merged.make_request(**spec)))
        loop.run_once()
    while not all(h.future.done() for h in handles):
        loop.run_once()
    assert loop.stats().beam_forwards < loop.stats().beam_steps
    for spec, h in zip(specs, handles):
        [ref] = separate.generate([separate.make_request(**spec)])
        assert_same_beams_within(dict(ranking(h.future.result())), dict(ranking(ref)), BEAM_TOL)


def assert_each_wave_selects_on_its_rows(wave, states, parts, got, hidden, start) -> None:  # type: ignore[no-untyped-def]
    """`got[i]` is exactly wave i's own selection (`BeamWave._select_step`) on its rows of
    `hidden`, the waves' rows back to back from row `start`."""
    for state, part, sel in zip(states, parts, got):
        rows = part.beams.num_rows
        want = wave._select_step(state, part, hidden[start : start + rows])
        start += rows
        for name in ("parent", "code", "node", "score"):
            assert torch.equal(getattr(sel, name), getattr(want, name)), (
                f"level {state.level}: {name}"
            )


def _graph_stack_engine(checkpoint: Path):
    """The CUDA engine's backend stack on the CPU (BF16; Triton prefill over Triton beam steps,
    interpreted, over torch; the fused FP8 paths off) with merged steps."""
    return make_engine(
        checkpoint, dtype="bfloat16", beam_attention="triton", prefill_attention="triton",
        triton_on_cpu=True, merge_beam_steps=True, enable_fused_rms_fp8=False,
        enable_fused_silu_fp8=False, enable_fused_qk_rope_kv=False,
    )  # fmt: skip


def test_a_merged_graph_shape_plans_through_the_engines_backend_stack(checkpoint: Path) -> None:
    """What a merged step's forward graph replays, without the capture (CPU): the engine's
    backend stack (Triton prefill over Triton beam steps over torch) plans a merged step padded
    with pad requests into the fixed graph buffers, own slots widened to depth - 1; the
    model forward on that plan equals the same padded step planned eagerly, bit for bit (the
    same shapes and kernels: only the plan's buffers differ)."""
    pytest.importorskip("triton")
    from flashrec_core.engine.beam_inputs import pad_requests_step

    engine = _graph_stack_engine(checkpoint)
    runner, depth = engine.runner, engine.wave.depth
    gen = torch.Generator().manual_seed(3)
    parts = [
        _wave_step(gen, [4, 4], [6, 9], level=1, first_slot=300),
        _wave_step(gen, [4], [5], level=2, first_slot=310),
    ]
    step = concat_beam_steps(parts)
    vocab = runner.config.vocab_size
    step = step.__class__(**{**step.__dict__, "input_ids": torch.randint(0, vocab, (12,))})
    padded = concat_beam_steps([step, pad_requests_step(1, 4, CPU)])  # 3 real + 1 pad = 4
    eager = runner.forward(padded)
    attention = runner.attn_backend.graph_attention(4, 16, suffix_width=depth - 1)
    metadata = runner.attn_backend.plan(padded, graph=attention)
    [group] = metadata.per_group
    assert group.suffix.shape == (16, depth - 1) and group.max_rows_per_request == 4
    assert group.suffix[:8, 1:].eq(-1).all() and group.suffix[12:, 1:].eq(-1).all()
    hidden = runner.forward_batch(
        padded.input_ids, padded.positions, padded.out_cache_loc, metadata
    )
    # real rows only: the pad rows all write the pad slot, and which write lands is not defined
    assert torch.equal(hidden[:12], eager[:12]), "the graph plan computes other than the eager"


def test_merged_graph_shapes_cover_the_waves_a_server_has_in_flight() -> None:
    """The shapes the warm-up captures: every run of waves at distinct levels, oldest first,
    at each small padded count; cut to MAX_MERGED_SHAPES by dropping the largest counts; none
    where one wave alone is over MERGE_MAX_ROWS."""
    from flashrec_core.engine.cuda_graph import (
        MAX_MERGED_SHAPES,
        merge_counts,
        merged_rows,
        merged_shapes,
    )

    assert merge_counts(50, 8192) == [1, 2, 4, 8]  # 8 x 50 = 400 rows; 16 x 50 is over 512
    assert merge_counts(512, 8192) == [1] and merge_counts(1024, 8192) == []
    depth3 = merged_shapes(50, 3, 8192)
    assert len(depth3) == 16 and ((2, 8), (1, 1)) in depth3
    assert all([level for level, _ in shape] == [2, 1] for shape in depth3)
    depth4 = merged_shapes(50, 4, 8192)  # 4 counts give 3 x 16 + 64 = 112 shapes: cut to 3
    assert len(depth4) == 3 * 9 + 27 <= MAX_MERGED_SHAPES
    assert ((3, 4), (1, 4)) in depth4 and ((3, 1), (2, 2), (1, 4)) in depth4
    assert not any(count == 8 for shape in depth4 for _, count in shape)
    assert merged_shapes(1024, 3, 8192) == [] and merged_shapes(50, 2, 8192) == []
    # a wave's rows in a merged graph are its padded rows (3 requests of 50 replay a 4-request
    # graph); a wave that runs eagerly (None: sampled, mixed n) or pads past 8 steps alone
    assert merged_rows(4, 50, 8192) == 200
    assert merged_rows(None, 50, 8192) is None and merged_rows(16, 50, 8192) is None
    assert merged_rows(1, 512, 8192) == 512 and merged_rows(1, 1024, 8192) is None


def test_merged_steps_default_to_where_merged_graphs_run(checkpoint: Path) -> None:
    """EngineConfig.merge_beam_steps None (the default) is on only where steps replay CUDA
    graphs with the Triton beam kernel: off on this CPU engine; True turns the eager merge
    on; the CLI's --merge-beam-steps / --no-merge-beam-steps set it either way."""
    from flashrec_core.cli import _bench_engine_settings, _build_parser, engine_fields

    assert make_engine(checkpoint).wave.merge_steps is False
    assert make_engine(checkpoint, merge_beam_steps=True).wave.merge_steps is True
    parser = _build_parser()
    flags = ([], ["--merge-beam-steps"], ["--no-merge-beam-steps"])
    generate = [
        engine_fields(parser.parse_args(["generate", "--prompt", "w1", "--model-path", "/m", *f]))
        for f in flags
    ]
    assert [g["merge_beam_steps"] for g in generate] == [None, True, False]
    bench = [
        _bench_engine_settings(parser.parse_args(["bench", "--engine", "/m", *f])) for f in flags
    ]
    assert [b.get("merge_beam_steps") for b in bench] == [None, True, False]


@pytest.mark.parametrize("filtered", [(), (0, 1), (0,)], ids=["unfiltered", "both", "older"])
def test_a_merged_graphs_work_selects_as_the_eager_merged_step(
    checkpoint: Path, filtered: tuple[int, ...]
) -> None:
    """What a merged step graph records, run eagerly on the CPU (`DecodeGraphs.run_merged`
    with replay=False): two real waves in flight (levels 2 and 1) planned into the graph
    buffers with own slots widened to depth - 1, one forward, each wave's selection on its
    slice of rows, scores and nodes, filtered waves (`filtered`: which) through their
    level's mask buffer. It must select exactly as the eager merged step does
    (`advance_together` without graphs: the same forward on an eager plan, then each wave's
    selection with its own masks): the same kernels over the same rows, so any wrong
    offset, level, buffer or mask shows as a different parent, code, node or score. The
    filters allow 8 items, so at every level a selection that ignored them would differ."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from flashrec_core.engine.cuda_graph import DecodeGraphs, MergedPart

    engine = _graph_stack_engine(checkpoint)
    wave, loop = engine.wave, engine.loop
    allowed = list(engine.catalog_index.item_ids[::7][:8])
    handles = []
    for i, prompt in enumerate(("w1 w2 w3", "w4 w5")):
        extra = {"allow_items": allowed} if i in filtered else {}
        handles.append(loop.submit(engine.make_request(prompt=prompt, n=4, **extra)))
        loop.run_once()
    states = [w.state for w in loop._waves]
    assert [s.level for s in states] == [2, 1], "one wave per level in flight"
    assert [s.masks is not None for s in states] == [i in filtered for i in range(2)]
    parts = [wave._step_parts(s, pad=False) for s in states]
    graphs = DecodeGraphs(engine.runner, wave.selector, wave.trie, wave.max_rows)
    merged = [
        MergedPart(s.level, p.step, p.sel.score, p.sel.node, p.beams, s.masks)
        for s, p in zip(states, parts)
    ]  # fmt: skip
    variant = states[0].variant
    recorded = graphs.run_merged(merged, wave.depth - 1, variant, replay=False)
    unmasked = graphs.run_merged(
        [replace(m, masks=None) for m in merged], wave.depth - 1, variant, replay=False
    )
    hidden = engine.runner.forward(concat_beam_steps([p.step for p in parts]))
    assert recorded is not None and unmasked is not None and len(recorded) == 2
    assert_each_wave_selects_on_its_rows(wave, states, parts, recorded, hidden, 0)
    for i in filtered:
        assert not torch.equal(recorded[i].node, unmasked[i].node), "the filter changed nothing"
    while not all(h.future.done() for h in handles):  # the waves finish; nothing leaks
        loop.run_once()
    assert_idle(engine)
