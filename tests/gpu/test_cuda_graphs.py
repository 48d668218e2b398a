"""Whole-step CUDA graphs: replay == the same step run eagerly, and the engine uses them."""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import pytest
import torch

from flashrec_core.attention.fresh_prefill import FreshPrefillAttention
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import PrefillProgress, prepare_beam_decode
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.engine.prefill_graph import prefill_shape
from flashrec_core.engine.scheduler import prefill_chunks
from flashrec_core.registry import Registry
from flashrec_core.search.beam import BeamLayout
from flashrec_core.search.filters import FilterMasks
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import hf_beam_search, teacher_forced_logprob

pytestmark = pytest.mark.gpu


@pytest.fixture(
    scope="module", params=["cascade", "flat", "triton", "triton-backend-prefill", "fresh-prefill"]
)
def engine_and_hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Beam steps through FlashInfer's cascade, flat decode or the Triton kernel; prefills
    through FlashInfer (cascade, triton-backend-prefill), the Triton prefill kernel (flat,
    triton) or FlashInfer's ragged prefill over the prompts' own K/V (fresh-prefill)."""
    prefill = {"flat": "triton", "triton": "triton", "fresh-prefill": "fresh"}
    return _engine_and_hf(
        tmp_path_factory.mktemp("graphs"), cascade_attention=request.param != "flat",
        beam_attention="cascade" if request.param in ("cascade", "flat") else "triton",
        prefill_attention=prefill.get(request.param, "backend"),
    )  # fmt: skip


def _engine_and_hf(path, **fields: object):
    """A CUDA engine (BF16, tiny Qwen3 of the GPU shape, a 400-item catalog) with `fields` set,
    and the fp32 transformers model of the same weights."""
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    hf = write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(path / "c.json", random_codes(400, seed=3))
    cfg = EngineConfig(
        model_path=str(path), device="cuda", show_progress=False, kv_cache_tokens=1 << 15,
        max_wave_rows=256, quantization="none", **fields,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog))), hf


@pytest.fixture()
def engine(engine_and_hf) -> Engine:
    return engine_and_hf[0]


def _step(engine: Engine, layout: BeamLayout, seed: int, level: int = 2, first_own: int = 2000):
    """A beam step at `level` over random (valid) slots, positions, scores and trie nodes."""
    gen = torch.Generator().manual_seed(seed)
    dev = engine.runner.device
    rows, reqs = layout.num_rows, layout.widths.numel()
    prompt_lens = torch.randint(3, 9, (reqs,), generator=gen)
    prompts = torch.randint(1, 1000, (int(prompt_lens.sum()),), generator=gen).to(dev)
    history = torch.randint(1000, 2000, (rows, level - 1), generator=gen).to(dev)
    own = torch.arange(first_own, first_own + rows, device=dev)
    codes = torch.randint(0, LEVELS[level - 1], (rows,), generator=gen).to(dev)
    step = prepare_beam_decode(
        tokens=engine.layout.level_starts[level - 1] + codes,
        positions=prompt_lens.to(dev)[layout.row_request] + level - 1, prompts=prompts,
        prompt_lens=prompt_lens, row_request=layout.row_request.cpu(), history=history, own=own,
    )  # fmt: skip
    score = -torch.rand(rows, generator=gen).to(dev) * 5
    node = torch.randint(0, engine.trie.num_nodes(level), (rows,), generator=gen).to(dev)
    return level, step, score, node


def test_replay_equals_the_eager_step_exactly(engine: Engine) -> None:
    graphs = engine.wave.graphs
    assert graphs is not None
    layout = BeamLayout.create([8] * 4, engine.runner.device)
    for seed in range(3):  # the first call captures; later ones re-plan and replay
        level, step, score, node = _step(engine, layout, seed)
        replayed = graphs.run(level, step, score, node, layout)
        eager = graphs.run_uncaptured(level, step, score, node, layout)
        for name in ("parent", "code", "node", "score"):
            a, b = getattr(replayed, name), getattr(eager, name)
            assert torch.equal(a, b), f"seed {seed}: {name} differs between replay and eager"
    assert graphs.stats.captures == 1 and graphs.stats.replays == 3


def test_prefill_replay_equals_the_eager_prefill_exactly(engine: Engine) -> None:
    """A prefill graph replay == the same padded forward run eagerly on the same buffers and plan,
    for fresh and partly cached prompts; one capture serves every replay of its shape."""
    prefill = engine.wave.prefill_graphs
    assert prefill is not None
    runner, gen = engine.runner, torch.Generator().manual_seed(5)
    captures, shapes = prefill.stats.captures, set()
    for seed, cached in enumerate((False, True, True)):
        vocab = runner.config.vocab_size
        prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (37, 90, 12)]
        slots = [runner.allocator.alloc(len(p)) for p in prompts]
        try:
            if cached:
                runner.forward(prepare_prefill(prompts, slots))
            step = prepare_prefill(prompts, slots, [10, 45, 3] if cached else None)
            last = (step.qo_indptr[1:] - 1).to(runner.device)
            shapes.add(prefill_shape(step.input_ids.numel(), len(prompts), prefill.buckets))
            replayed = prefill.run(step, last)
            eager = prefill.run_uncaptured(step, last)
            assert replayed is not None and torch.equal(replayed, eager), f"seed {seed}"
            unpadded = runner.forward(step)[last]  # GEMMs of another row count: bf16 rounding
            assert (replayed.float() - unpadded.float()).abs().max() < 0.05 * unpadded.abs().max()
        finally:
            for s in slots:
                runner.allocator.free(s)
    # 139 fresh tokens -> (256, 5), 81 uncached -> (128, 5): each captured once at most (maybe
    # before this test), then replayed
    assert shapes == {(256, 5), (128, 5)}
    assert prefill.stats.captures - captures <= len(shapes)


def test_a_prefill_mostly_cached_replays_a_graph(engine: Engine) -> None:
    """Prompts whose cached prefix outweighs their new tokens (a returning user's history
    plus a few items): 19 new tokens after 320 cached replay a graph, equal to the same
    forward run eagerly. The fresh prefill has room for as many context rows as the shape has
    tokens (128, the smallest bucket), fewer than 320, so it replays the wrapped backend's
    graph of that shape (captured on first use; before, such prefills ran eagerly)."""
    prefill = engine.wave.prefill_graphs
    assert prefill is not None
    runner, gen = engine.runner, torch.Generator().manual_seed(9)
    vocab = runner.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (137, 190, 12)]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    cached = [130, 180, 10]
    try:
        runner.forward(prepare_prefill(prompts, slots))
        step = prepare_prefill(prompts, slots, cached)
        last = (step.qo_indptr[1:] - 1).to(runner.device)
        shape = prefill_shape(step.input_ids.numel(), len(prompts), prefill.buckets)
        assert shape is not None and shape[0] < sum(cached), "the context must not fit the shape"
        replays = prefill.stats.replays
        replayed = prefill.run(step, last)
        assert replayed is not None and prefill.stats.replays == replays + 1
        assert torch.equal(replayed, prefill.run_uncaptured(step, last))
        unpadded = runner.forward(step)[last]  # GEMMs of another row count: bf16 rounding
        assert (replayed.float() - unpadded.float()).abs().max() < 0.05 * unpadded.abs().max()
        if isinstance(runner.attn_backend, FreshPrefillAttention):
            assert (*shape, True) in prefill._graphs
    finally:
        for s in slots:
            runner.allocator.free(s)


def test_a_chunked_prefill_replays_graphs_and_matches_one_forward(engine: Engine) -> None:
    """Prompts of 37, 90, 12 and 64 tokens in forwards of at most 50 new tokens: most prompts
    span two or three forwards (a later piece attends to the KV an earlier replay wrote); every
    forward replays a prefill graph, each re-planning the shared index buffers while the GPU
    may still run the one before; the last hidden states match one eager forward of the whole
    wave (GEMMs of other row counts: bf16 rounding, as in the test above)."""
    runner, wave, gen = engine.runner, engine.wave, torch.Generator().manual_seed(7)
    prefill = wave.prefill_graphs
    assert prefill is not None
    vocab = runner.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (37, 90, 12, 64)]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    replays = prefill.stats.replays
    try:
        lengths = [len(p) for p in prompts]
        pieces = deque(prefill_chunks(lengths, [0] * len(prompts), 50))
        progress = PrefillProgress(prompts, lengths, pieces)
        assert wave.prefill_forwards(progress, slots)
        chunked = torch.cat(progress.parts)
        assert prefill.stats.replays - replays == 5, "203 tokens: five forwards, all replays"
        step = prepare_prefill(prompts, slots)
        whole = runner.forward(step)[(step.qo_indptr[1:] - 1).to(runner.device)]
        assert chunked.shape == whole.shape
        assert (chunked.float() - whole.float()).abs().max() < 0.05 * whole.abs().max()
    finally:
        for s in slots:
            runner.allocator.free(s)


BF16_BOUND = 0.3
"""2 x the BF16 torch path's own worst error on these tiny models (0.14, measured on CPU against
fp32 transformers; see test_gpu_engine) + 0.02. A wrong plan or slot gives whole nats."""


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_padded_and_cached_waves_score_like_transformers(engine_and_hf, mode: str) -> None:
    """Three requests of n=8 (graphs pad them to 4), run uncached then with every prompt in the
    prefix cache: each beam scores as fp32 transformers scores it, and the beams are as good as
    transformers' beam search's. Graph and eager paths are checked separately so that a failure
    names the path."""
    engine, hf = engine_and_hf
    graphs = engine.wave.graphs
    assert graphs is not None
    offset = 0 if mode == "graphs" else 10  # fresh prompts: the first run is uncached
    reqs = [engine.make_request(prompt=f"user w{i + offset} w{i + 3} item", n=8) for i in range(3)]
    # eager: same engine and weights, eager steps at the same padded shape
    with engine.wave.eager_steps(pad_to=lambda widths: 4) if mode == "eager" else nullcontext():
        for run in ("uncached", "cached"):
            before = graphs.stats.replays
            prefill = engine.wave.prefill_graphs
            prefills_before = prefill.stats.replays if prefill is not None else 0
            for req, res in zip(reqs, engine.generate(reqs)):
                for c in res.choices:
                    exact = teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
                    assert abs(c.logprob - exact) < BF16_BOUND, (
                        f"{mode}, {run}: {c.codes} scored {c.logprob:.4f}, fp32 {exact:.4f}"
                    )
                theirs = hf_beam_search(hf, req.prompt_ids, 8, engine.layout, engine.catalog.codes)
                ours = [teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
                        for c in res.choices]  # fmt: skip
                gap = sum(lp for _, lp in theirs) / len(theirs) - sum(ours) / len(ours)
                assert gap < BF16_BOUND, f"{mode}, {run}: beams worse than transformers' by {gap}"
            replays = graphs.stats.replays - before
            assert replays == (len(LEVELS) - 1 if mode == "graphs" else 0)
            if mode == "graphs":  # the three prompts' prefill replayed its graph too
                assert prefill is not None and prefill.stats.replays - prefills_before == 1


def test_sampling_waves_fall_back_to_eager_and_say_why(engine: Engine) -> None:
    graphs = engine.wave.graphs
    assert graphs is not None
    eager_before = graphs.stats.eager_steps
    req = engine.make_request(prompt="user w1 item", n=4, temperature=0.7, seed=1)
    [res] = engine.generate([req])
    assert len(res.choices) == 4
    assert graphs.stats.eager_steps - eager_before == len(LEVELS) - 1
    assert any("sampling" in reason for reason in graphs.stats.eager_reasons)


def test_a_failed_capture_runs_eagerly_and_says_why(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphs = engine.wave.graphs
    assert graphs is not None

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(graphs, "_capture", fail)
    eager_before = graphs.stats.eager_steps
    try:
        [res] = engine.generate([engine.make_request(prompt="user w5 w6 item", n=3)])
        assert len(res.choices) == 3
        assert graphs.stats.eager_steps - eager_before == len(LEVELS) - 1
        assert any("simulated capture failure" in why for why in graphs.stats.eager_reasons)
    finally:
        graphs._failed.clear()


def test_filtered_replay_equals_the_eager_step_and_the_masks_bite(engine: Engine) -> None:
    """A filtered step replays its own graph, which reads the wave's masks from its buffer:
    replay == the same step run eagerly, and the masks change the selection."""
    graphs = engine.wave.graphs
    assert graphs is not None
    index = engine.catalog_index
    layout = BeamLayout.create([8] * 3, engine.runner.device)  # 3 real of a 4-request graph
    padded = BeamLayout.create([8] * 4, engine.runner.device)
    items = index.item_ids
    for seed in range(3):
        filters = [index.create_filter(exclude_items=items[(seed + i) % 5 :: 2]) for i in range(3)]
        masks = FilterMasks.create(filters, index, engine.trie, engine.runner.device)
        level, step, score, node = _step(engine, padded, seed)
        score[layout.num_rows :] = float("-inf")  # pad rows start dead, as in the engine
        replayed = graphs.run(level, step, score, node, padded, masks=masks)
        eager = graphs.run_uncaptured(level, step, score, node, padded, masks=masks)
        unfiltered = graphs.run_uncaptured(level, step, score, node, padded)
        for name in ("parent", "code", "node", "score"):
            a, b = getattr(replayed, name), getattr(eager, name)
            assert torch.equal(a, b), f"seed {seed}: {name} differs between replay and eager"
        rows = layout.num_rows
        assert not torch.equal(replayed.node[:rows], unfiltered.node[:rows]), "masks had no effect"


def test_filtered_waves_replay_graphs_and_return_only_allowed_items(engine_and_hf) -> None:
    engine, hf = engine_and_hf
    graphs = engine.wave.graphs
    assert graphs is not None
    items = engine.catalog_index.item_ids
    excluded = [set(items[i::3]) for i in range(3)]
    reqs = [
        engine.make_request(prompt=f"user w{i + 20} item", n=8, exclude_items=sorted(excluded[i]))
        for i in range(3)
    ]
    replays, eager = graphs.stats.replays, graphs.stats.eager_steps
    results = engine.generate(reqs)
    assert graphs.stats.replays - replays == len(LEVELS) - 1, "one replay per beam step"
    assert graphs.stats.eager_steps == eager
    for req, res, gone in zip(reqs, results, excluded):
        assert len(res.choices) == 8
        for c in res.choices:
            assert c.items and not set(c.items) & gone, f"{c.items} holds an excluded item"
            exact = teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
            assert abs(c.logprob - exact) < BF16_BOUND


@pytest.fixture(scope="module")
def merged_engine_and_hf(tmp_path_factory: pytest.TempPathFactory):
    """The "triton" engine of `engine_and_hf` with merge_beam_steps: small waves in flight
    step through one merged graph per iteration."""
    return _engine_and_hf(
        tmp_path_factory.mktemp("merged"), beam_attention="triton", prefill_attention="triton",
        merge_beam_steps=True,
    )  # fmt: skip


def test_a_merged_step_replays_like_its_captured_work_run_eagerly(merged_engine_and_hf) -> None:
    """Waves at levels 2 and 1 (2 and 4 requests of 8 rows, capture counts both) through one
    merged graph: each wave's selection from the replay equals the captured work run eagerly
    on the same buffers and plan, exactly; one capture serves the later replay."""
    from flashrec_core.engine.cuda_graph import MergedPart

    engine, _ = merged_engine_and_hf
    graphs, dev = engine.wave.graphs, engine.runner.device
    assert graphs is not None and engine.wave.merge_steps
    captures, replays = graphs.stats.captures, graphs.stats.merged_replays
    for seed in range(2):
        parts = []
        for k, (level, layout) in enumerate(
            [(2, BeamLayout.create([8] * 2, dev)), (1, BeamLayout.create([8] * 4, dev))]
        ):
            _, step, score, node = _step(engine, layout, seed + k, level, 2000 + 100 * k)
            parts.append(MergedPart(level, step, score, node, layout))
        replayed = graphs.run_merged(parts, len(LEVELS) - 1, None)
        eager = graphs.run_merged(parts, len(LEVELS) - 1, None, replay=False)
        assert replayed is not None and eager is not None and len(replayed) == 2
        for part, a, b in zip(parts, replayed, eager):
            assert a.score.shape[0] == part.layout.num_rows
            for name in ("parent", "code", "node", "score"):
                assert torch.equal(getattr(a, name), getattr(b, name)), f"seed {seed}: {name}"
    assert graphs.stats.captures - captures <= 1, "one capture (none if a test before took it)"
    assert graphs.stats.merged_replays - replays == 2


@pytest.mark.parametrize("schedule", ["interleaved", "admit_first"])
def test_merged_waves_score_like_transformers(merged_engine_and_hf, schedule: str) -> None:
    """Requests joining every iteration (waves at levels 1 and 2 in flight; admit_first: a new
    wave's first step in the forward of the wave before it's last, whose results then wait
    for the next iteration when its copy is queued behind the prefill): greedy waves,
    filtered ones (an exclude list, an allow list) and a sampled one (it steps alone). Waves in
    flight together replay merged step graphs (greedy with greedy, greedy with filtered,
    filtered with filtered; with `mixed_prefill_tokens` set, inside the next request's prefill:
    mixed graphs); every returned beam scores as fp32 transformers scores it (a
    wrong slot, level or row offset gives whole nats) and keeps to its request's filter (a
    mask buffer read wrong lets other items through)."""
    engine, hf = merged_engine_and_hf
    graphs, loop = engine.wave.graphs, engine.loop
    assert graphs is not None
    loop.schedule = schedule  # type: ignore[assignment]  # put back below
    try:
        _merged_waves_score_like_transformers(engine, hf)
    finally:
        loop.schedule = "interleaved"


def _merged_waves_score_like_transformers(engine: Engine, hf) -> None:
    graphs, loop = engine.wave.graphs, engine.loop
    assert graphs is not None
    items = engine.catalog_index.item_ids
    specs = [
        dict(prompt="user w1 w2 item", n=8),
        dict(prompt="user w8 w9 item", n=8),
        dict(prompt="user w3 item", n=8, exclude_items=list(items[::3])),
        dict(prompt="user w2 w6 item", n=8, allow_items=list(items[1::5])),
        dict(prompt="user w4 w5 w6 item", n=8, temperature=0.7, seed=2),
        dict(prompt="user w7 item", n=8),
    ]
    replays, steps, forwards = (
        graphs.stats.merged_replays + graphs.stats.mixed_replays,
        loop.stats().beam_steps,
        loop.stats().beam_forwards,
    )
    requests, handles = [], []
    for spec in specs:
        requests.append(engine.make_request(**spec))
        handles.append(loop.submit(requests[-1]))
        loop.run_once()
    while not all(h.future.done() for h in handles):
        loop.run_once()
    stats = loop.stats()
    assert stats.beam_steps - steps == 2 * len(specs)
    assert stats.beam_forwards - forwards < stats.beam_steps - steps, "no merged forward"
    assert graphs.stats.merged_replays + graphs.stats.mixed_replays > replays
    for spec, req, h in zip(specs, requests, handles):
        for c in h.future.result().choices:
            exact = teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
            assert abs(c.logprob - exact) < BF16_BOUND, f"{c.codes}: {c.logprob:.4f} vs {exact:.4f}"
            # a choice's items are its SID's items that the request's filter keeps: none left
            # means the beam went where the filter's masks should have closed
            assert c.items, f"{spec}: {c.codes} has no item the request allows"


def test_warm_up_captures_merged_steps_so_traffic_only_replays(merged_engine_and_hf) -> None:
    from flashrec_core.server.warmup import warm_up

    engine, _ = merged_engine_and_hf
    graphs, loop = engine.wave.graphs, engine.loop
    assert graphs is not None
    warm_up(engine, [4], progress=False)
    captures, replays = graphs.stats.captures, graphs.stats.merged_replays
    handles = []
    for i in range(4):  # waves of one request joining every iteration: merged steps of 1-2 waves
        handles.append(loop.submit(engine.make_request(prompt=f"user w{i + 30} item", n=4)))
        loop.run_once()
    while not all(h.future.done() for h in handles):
        loop.run_once()
    assert all(len(h.future.result().choices) == 4 for h in handles)
    assert graphs.stats.merged_replays > replays
    assert graphs.stats.captures == captures, "traffic captured a graph the warm-up left out"
