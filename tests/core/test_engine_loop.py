"""The engine loop driven step by step: admission between steps, cancellation and deadlines that
free a wave's rows, KV slots, table rows and prefix locks, the bounded queue, and results that
equal the same requests run alone."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.handles import (
    DeviceMemoryError,
    EngineStoppedError,
    QueueFullError,
    RequestCancelledError,
    RequestRejectedError,
    RequestTimeoutError,
)
from flashrec_core.testing.hf_beam import assert_same_ranking

ATOL_SAME_ENGINE = 1e-5  # one fp32 engine, two batch compositions (see beam_conformance)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("loop") / "ckpt"
    write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=800, seed=1)
    return path


def make_engine(path: Path, **fields: object) -> Engine:
    cfg = EngineConfig(model_path=str(path), device="cpu", kv_cache_tokens=4096, max_wave_rows=64,
                       show_progress=False, **fields)  # fmt: skip
    return Engine.from_config(
        cfg, SearchConfig(catalog_path=str(path / "catalog.json")), max_queue=8
    )


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return make_engine(checkpoint)


def assert_idle(engine: Engine) -> None:
    s = engine.loop.stats()
    assert (s.queued, s.running_requests, s.running_rows, s.request_slots_used) == (0, 0, 0, 0)
    assert s.prefix_cache_locked_nodes == 0
    assert s.kv_slots_free + s.kv_slots_cached == s.kv_slots_total, "a KV slot leaked"


def ranking(result) -> list[tuple[tuple[int, ...], float]]:
    return [(c.codes, c.logprob) for c in result.choices]


def finish_and_compare(loop, handles, references) -> None:
    """Drive the loop until every handle is done; each answer must rank like its reference."""
    while not all(h.future.done() for h in handles):
        loop.run_once()
    for h, ref in zip(handles, references):
        assert_same_ranking(ranking(h.future.result()), ranking(ref), ATOL_SAME_ENGINE)


def _finish_and_compare_alone(engine: Engine, handles: list) -> None:
    """Drive the loop until every handle is done, then serve each request alone (after, so
    that the requests in flight prefilled fresh prompts): the same ranking."""
    while not all(h.future.done() for h in handles):
        engine.loop.run_once()
    for h in handles:
        [alone] = engine.generate([h.request])
        assert_same_ranking(ranking(h.future.result()), ranking(alone), ATOL_SAME_ENGINE)


def test_a_request_joins_while_another_wave_runs(engine: Engine) -> None:
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="w1 w2 w3", n=8))
    loop.run_once()  # admitted and prefilled: the wave is at level 1
    second = loop.submit(engine.make_request(prompt="w4 w5", n=4))
    loop.run_once()  # first takes level 2 while second is admitted alongside it
    assert loop.stats().running_requests == 2
    assert second.admitted_at is not None, "admitted at the next step boundary"
    while not (first.future.done() and second.future.done()):
        loop.run_once()
    for h in (first, second):
        [alone] = engine.generate([h.request])
        assert_same_ranking(ranking(h.future.result()), ranking(alone), ATOL_SAME_ENGINE)
    assert_idle(engine)


def test_an_admitted_prefill_carries_the_step_of_the_wave_in_flight(engine: Engine) -> None:
    """Eagerly (the CPU), a wave admitted beside one in flight prefills in the forward that
    takes the other's beam step (mixed_prefill_steps): one forward, both answers as alone."""
    loop = engine.loop
    # prompts of no other test, so that their prefills compute them (nothing cached)
    first = loop.submit(engine.make_request(prompt="w11 w12 w13", n=8))
    loop.run_once()  # alone: nothing in flight to carry
    before = loop.stats()
    second = loop.submit(engine.make_request(prompt="w14 w15 w16 w17", n=4))
    loop.run_once()  # second's whole prefill + first's level-2 step, one forward
    after = loop.stats()
    assert after.mixed_forwards == before.mixed_forwards + 1
    assert (after.beam_steps, after.beam_forwards) == (before.beam_steps + 1,
                                                       before.beam_forwards + 1)  # fmt: skip
    assert after.waves_admitted == before.waves_admitted + 1
    _finish_and_compare_alone(engine, [first, second])
    assert_idle(engine)


def _copies_as(monkeypatch: pytest.MonkeyPatch, beams_class: type) -> None:
    """The loop's finished beams come back as `beams_class` (a HostBeams subclass), so a test
    can say when their copy to the host lands."""
    from flashrec_core.engine import loop as loop_module

    real = loop_module.copy_to_host

    def copy(out):  # type: ignore[no-untyped-def]
        beams = real(out)
        return beams_class(beams.codes_nodes, beams.path_scores, beams.copied)

    monkeypatch.setattr(loop_module, "copy_to_host", copy)


@pytest.fixture
def copies_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every beams' copy to the host reports itself still running (`HostBeams.ready`). On the
    CPU a copy is done at once; with this, only the loop's rules for when to wait deliver."""
    from flashrec_core.engine.results import HostBeams

    class StillCopying(HostBeams):
        def ready(self) -> bool:
            return False

    _copies_as(monkeypatch, StillCopying)


@pytest.mark.usefixtures("copies_still_running")
def test_results_copying_behind_a_mixed_forward_wait_one_iteration(engine: Engine) -> None:
    """A wave whose last step ran in the admission's mixed forward, and whose beams' copy to
    the host has not landed by the end of that iteration, is delivered at the end of the next
    one (on CUDA its copy is queued behind the whole mixed forward, and waiting would idle the
    GPU while the host prepares the next iteration), waiting for the copy then."""
    loop = engine.loop
    handles = []
    for prompt in ("w41 w42 w43", "w44 w45", "w46 w47 w48 w49"):
        handles.append(loop.submit(engine.make_request(prompt=prompt, n=4)))
        loop.run_once()  # each wave one level ahead of the next
    first, second, third = handles
    assert loop.stats().mixed_forwards >= 2, "first's last step rode in third's prefill"
    assert not first.future.done(), "delivered while its copy ran and other work was queued"
    loop.run_once()  # nothing queued, no mixing: second's last step in the step phase
    assert first.future.done(), "one iteration late at most"
    assert second.future.done(), "a wave finished in the step phase waits for its copy"
    _finish_and_compare_alone(engine, handles)
    assert_idle(engine)


@pytest.mark.usefixtures("copies_still_running")
def test_a_wave_finished_in_the_step_phase_is_delivered_in_its_iteration(
    checkpoint: Path,
) -> None:
    """A wave that finished in the step phase is delivered in the same iteration, waiting for
    its copy, whether the admission's prefill is queued after the copy (the GPU runs it while
    the host waits and assembles) or no wave was admitted (deferring it lengthened the tail on
    an H100, session 31: `_deliver`)."""
    engine = make_engine(checkpoint, mixed_prefill_steps=False)
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="w61 w62 w63", n=4))
    loop.run_once()  # first: level 1
    second = loop.submit(engine.make_request(prompt="w64 w65", n=4))
    loop.run_once()  # first: level 2; second admitted
    third = loop.submit(engine.make_request(prompt="w66 w67 w68", n=4))
    loop.run_once()  # first's last step, then third's prefill queued after its copy
    assert first.future.done(), "a prefill followed its copy"
    loop.run_once()  # second's last step; no admission, third in flight
    assert second.future.done(), "no admission, third in flight"
    _finish_and_compare_alone(engine, [first, second, third])
    assert_idle(engine)


def test_the_loop_counts_its_waits_for_results_copies(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`results_wait_seconds` is the time the loop blocked on finished beams' copies (on CUDA,
    how far the GPU ran ahead of the host): here every copy takes 30 ms to land."""
    from flashrec_core.engine.results import HostBeams

    class SlowCopy(HostBeams):
        def wait(self) -> None:
            time.sleep(0.03)

    _copies_as(monkeypatch, SlowCopy)
    before = engine.loop.stats()
    [result] = engine.generate([engine.make_request(prompt="w71 w72", n=4)])
    after = engine.loop.stats()
    waited = after.results_wait_seconds - before.results_wait_seconds
    assert 0.03 <= waited <= after.busy_seconds - before.busy_seconds
    assert result.choices


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"mixed_prefill_steps": False}, "turned off"),
     ({"prefill_chunk_tokens": 4}, "a prefill of several forwards")],
)  # fmt: skip
def test_a_prefill_that_cannot_carry_steps_runs_apart(
    checkpoint: Path, fields: dict, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off, or when the admitted prefill takes several forwards, the wave in flight steps in
    its own forward, before the prefill (on CUDA its step and its finished beams' copy would
    otherwise queue behind the prefill); the answers are the same."""
    engine = make_engine(checkpoint, **fields)
    loop, wave = engine.loop, engine.wave
    order: list[str] = []
    real_step, real_prefill = wave.advance_together, wave.prefill_some

    def step(states):  # type: ignore[no-untyped-def]
        order.append("step")
        return real_step(states)

    def prefill(state, token_budget=None):  # type: ignore[no-untyped-def]
        order.append("prefill")
        return real_prefill(state, token_budget)

    monkeypatch.setattr(wave, "advance_together", step)
    monkeypatch.setattr(wave, "prefill_some", prefill)
    requests = [engine.make_request(prompt="w1 w2 w3", n=8),
                engine.make_request(prompt=LONG_PROMPT, n=4)]  # fmt: skip
    before = loop.stats()
    first = loop.submit(requests[0])
    loop.run_once()
    second = loop.submit(requests[1])
    order.clear()
    loop.run_once()
    assert order == ["step", "prefill"], why
    after = loop.stats()
    assert after.mixed_forwards == before.mixed_forwards, why
    assert after.beam_steps == before.beam_steps + 1
    assert after.waves_admitted == before.waves_admitted + 2
    _finish_and_compare_alone(engine, [first, second])
    assert_idle(engine)


def test_decode_first_admits_once_the_wave_in_flight_has_run_its_last_step(
    checkpoint: Path,
) -> None:
    """A decode-first loop steps the wave in flight to its end before the next prefill (which
    then runs in the iteration of that last step), and answers as the requests run alone."""
    engine = make_engine(checkpoint, schedule="decode_first")
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="w1 w2 w3", n=8))
    loop.run_once()  # first admitted and prefilled: level 1 of 3
    second = loop.submit(engine.make_request(prompt="w4 w5", n=4))
    loop.run_once()  # first's level 2
    assert second.admitted_at is None, "no prefill between the steps of the wave in flight"
    assert loop.stats().running_requests == 1
    loop.run_once()  # first's last step, then second's prefill
    assert first.future.done() and second.admitted_at is not None
    while not second.future.done():
        loop.run_once()
    for h in (first, second):
        [alone] = engine.generate([h.request])
        assert_same_ranking(ranking(h.future.result()), ranking(alone), ATOL_SAME_ENGINE)
    assert_idle(engine)


def test_admit_first_steps_a_new_wave_in_the_iteration_of_its_prefill(checkpoint: Path) -> None:
    """An admit-first loop prefills a new wave, then steps it in the same iteration, in the
    forward it shares with the wave in flight: a depth-3 wave finishes in two iterations, and
    both answer as alone."""
    engine = make_engine(checkpoint, schedule="admit_first", merge_beam_steps=True)
    loop = engine.loop
    first = loop.submit(engine.make_request(prompt="w21 w22 w23", n=8))
    loop.run_once()  # first's prefill (level 1), then its level-2 step
    s = loop.stats()
    assert (s.waves_admitted, s.beam_steps, s.beam_forwards) == (1, 1, 1)
    second = loop.submit(engine.make_request(prompt="w24 w25", n=4))
    loop.run_once()  # second's prefill, then one forward: first's last step, second's level 2
    s = loop.stats()
    assert (s.waves_admitted, s.beam_steps, s.beam_forwards, s.mixed_forwards) == (2, 3, 2, 0)
    assert first.future.done() and not second.future.done()
    loop.run_once()  # second's last step
    assert second.future.done()
    _finish_and_compare_alone(engine, [first, second])
    assert_idle(engine)


LONG_PROMPT = " ".join(f"w{i}" for i in range(4, 30))
"""More prompt tokens than three prefill pieces of PIECE tokens."""
PIECE = 4


@pytest.fixture(scope="module")
def chunked(checkpoint: Path) -> Engine:
    """Chunked prefill: forwards of PIECE tokens, one per iteration beside waves in flight."""
    return make_engine(checkpoint, prefill_chunk_tokens=PIECE, prefill_tokens_per_step=PIECE)


def test_chunked_prefill_steps_the_waves_in_flight_between_its_pieces(
    chunked: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt admitted beside a wave in flight prefills one piece per iteration while
    that wave takes its steps; once no wave is left to step, the rest runs at once. Both answer
    as alone."""
    loop, budgets = chunked.loop, []
    real = chunked.wave.prefill_some

    def prefill_some(state, token_budget=None) -> bool:
        budgets.append(token_budget)
        return real(state, token_budget)

    first = loop.submit(chunked.make_request(prompt="w1 w2 w3", n=8))
    loop.run_once()  # admitted alone: its whole prefill at once, now at level 1 of 3
    assert first.prefilled_at is not None
    monkeypatch.setattr(chunked.wave, "prefill_some", prefill_some)
    second = loop.submit(chunked.make_request(prompt=LONG_PROMPT, n=4))
    assert len(second.request.prompt_ids) > 3 * PIECE
    loop.run_once()  # first's level 2; second's first piece
    assert second.admitted_at is not None and second.prefilled_at is None
    assert loop.stats().running_requests == 2, "a wave prefilling in pieces is running"
    assert loop.stats().request_slots_used == 2
    loop.run_once()  # first's last step; nothing left to step: second's rest at once
    assert first.future.done() and second.prefilled_at is not None
    assert budgets == [PIECE, None]
    assert loop.stats().prefill_pieces == 1, "the rest ran in one later piece"
    finish_and_compare(loop, [second], [chunked.generate([second.request])[0]])
    assert_same_ranking(
        ranking(first.future.result()), ranking(chunked.generate([first.request])[0]),
        ATOL_SAME_ENGINE,
    )  # fmt: skip
    assert_idle(chunked)


def test_chunked_prefill_alone_runs_whole_and_matches_the_unchunked_engine(
    chunked: Engine, engine: Engine
) -> None:
    """With no wave in flight there is nothing to step between pieces: one iteration prefills
    it all. The pieces are the same forwards either way, so the answers equal an engine
    without chunked prefill (same prefill forwards of PIECE tokens)."""
    loop = chunked.loop
    handle = loop.submit(chunked.make_request(prompt=LONG_PROMPT, n=6))
    loop.run_once()
    assert handle.prefilled_at is not None
    while not handle.future.done():
        loop.run_once()
    unchunked = engine.generate([engine.make_request(prompt=LONG_PROMPT, n=6)])[0]
    assert_same_ranking(ranking(handle.future.result()), ranking(unchunked), 1e-4)
    assert_idle(chunked)


def test_a_request_cancelled_while_its_wave_prefills_in_pieces_is_freed(chunked: Engine) -> None:
    """Requests leave a wave only between beam steps: a cancel during its prefill takes effect
    once the prefill is done; then its rows, slots, table row and prefix locks are back."""
    loop = chunked.loop
    first = loop.submit(chunked.make_request(prompt="w1 w2 w3", n=8))
    loop.run_once()
    second = loop.submit(chunked.make_request(prompt=LONG_PROMPT, n=4))
    loop.run_once()  # second's first piece
    second.cancel("the client went away")
    while not (first.future.done() and second.future.done()):
        loop.run_once()
    with pytest.raises(RequestCancelledError, match="the client went away"):
        second.future.result()
    assert_idle(chunked)


def test_a_piece_out_of_device_memory_hands_the_wave_back_and_retries_smaller(
    chunked: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later piece of a chunked prefill runs out of memory: the wave's KV goes back and its
    requests retry as a smaller wave, answering as alone."""
    loop = chunked.loop
    first = chunked.make_request(prompt="w1 w2", n=4)
    fresh = " ".join(f"w{i}" for i in range(30, 56))  # in no earlier test's prefix cache
    requests = [chunked.make_request(prompt=f"{fresh} w{i}", n=4) for i in range(2)]
    real, calls = chunked.wave.prefill_some, []

    def prefill_some(state, token_budget=None) -> bool:
        calls.append(len(state.requests))
        if len(state.requests) > 1 and len(calls) == 2:  # the second piece of the pair
            raise torch.OutOfMemoryError("CUDA out of memory (a prefill piece)")
        return real(state, token_budget)

    handles = [loop.submit(first)]
    loop.run_once()
    before = loop.stats().admission_retries_memory
    monkeypatch.setattr(chunked.wave, "prefill_some", prefill_some)
    handles += [loop.submit(r) for r in requests]
    loop.run_once()  # the pair's first piece
    loop.run_once()  # its second piece: out of memory, the pair goes back to the queue
    assert loop.stats().admission_retries_memory == before + 1
    assert loop.stats().running_requests <= 1
    while not all(h.future.done() for h in handles):
        loop.run_once()
    assert max(calls[2:]) == 1, "the retries took one request each"
    monkeypatch.undo()
    for h in handles:  # as alone (their prompts are cached now, as in the other tests)
        alone = chunked.generate([h.request])[0]
        assert_same_ranking(ranking(h.future.result()), ranking(alone), ATOL_SAME_ENGINE)
    assert_idle(chunked)


def test_an_admission_delay_lets_the_queue_grow_into_one_wave(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the server's admission delay, requests that arrive while a wave runs wait (within
    the delay) and then share one wave; an idle engine admits at once."""
    loop = engine.loop
    requests = [engine.make_request(prompt=f"w{i} w5", n=4) for i in range(3)]
    alone = [engine.generate([r])[0] for r in requests]
    monkeypatch.setattr(loop, "admission_delay_factor", 1e6)  # longer than the test
    first = loop.submit(engine.make_request(prompt="w1 w2 w3", n=8))
    loop.run_once()
    assert first.admitted_at is not None, "an idle engine never waits"
    later = [loop.submit(r) for r in requests]
    before = loop.stats().waves_admitted
    while not first.future.done():
        loop.run_once()
        if not first.future.done():
            assert all(h.admitted_at is None for h in later), "admitted within the delay"
    finish_and_compare(loop, later, alone)
    assert loop.stats().waves_admitted - before == 1, "the three waited into one wave"
    assert_idle(engine)


def test_cancel_mid_wave_frees_that_request_only(engine: Engine) -> None:
    loop = engine.loop
    keep = loop.submit(engine.make_request(prompt="w9 w8 w7", n=8))
    drop = loop.submit(engine.make_request(prompt="w9 w8 w6", n=8))
    loop.run_once()
    assert loop.stats().running_rows == 16
    drop.cancel()
    loop.run_once()
    assert loop.stats().running_rows == 8, "the cancelled request's rows left at the boundary"
    with pytest.raises(RequestCancelledError):
        drop.future.result(timeout=0)
    while not keep.future.done():
        loop.run_once()
    [alone] = engine.generate([keep.request])
    assert_same_ranking(ranking(keep.future.result()), ranking(alone), ATOL_SAME_ENGINE)
    assert_idle(engine)


def test_deadline_passes_in_queue_and_in_flight(engine: Engine) -> None:
    loop = engine.loop
    queued = loop.submit(engine.make_request(prompt="w1", n=4), timeout=1e-6)
    time.sleep(0.001)
    loop.run_once()
    with pytest.raises(RequestTimeoutError):
        queued.future.result(timeout=0)
    running = loop.submit(engine.make_request(prompt="w2", n=4), timeout=0.05)
    loop.run_once()
    time.sleep(0.06)
    loop.run_once()
    with pytest.raises(RequestTimeoutError):
        running.future.result(timeout=0)
    assert_idle(engine)


def test_bounded_queue_and_rejected_requests(engine: Engine) -> None:
    loop = engine.loop
    handles = [loop.submit(engine.make_request(prompt=f"w{i}", n=2)) for i in range(8)]
    with pytest.raises(QueueFullError, match="queue is full"):
        loop.submit(engine.make_request(prompt="w1", n=2))
    for h in handles:
        h.cancel()
    loop.run_once()
    with pytest.raises(RequestRejectedError, match="beam-row budget") as info:
        loop.submit(engine.make_request(prompt="w1", n=65))
    assert info.value.param == "n"
    assert_idle(engine)


def _prefill_runs_out_of_memory_over(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, most: int
) -> list[int]:
    """The device's allocator refuses the activations of a prefill of more than `most`
    requests (what torch raises when a wave is too big for the memory the KV pool left);
    returns the sizes of the prefills that ran."""
    wave, ran = engine.wave, []
    real, real_mixed = wave.prefill_some, wave.begin_mixed

    def refuse(requests: list) -> None:
        if len(requests) > most:
            raise torch.OutOfMemoryError(f"CUDA out of memory (a prefill of {len(requests)})")

    def prefill_some(state, token_budget=None) -> bool:
        refuse(state.requests)
        done = real(state, token_budget)
        if done:
            ran.append(len(state.requests))
        return done

    def begin_mixed(requests, beside):  # a prefill carrying beam steps (mixed_prefill_steps)
        refuse(requests)
        state, stepped = real_mixed(requests, beside)
        if stepped:  # else its prefill ran through prefill_some, counted there
            ran.append(len(requests))
        return state, stepped

    monkeypatch.setattr(wave, "prefill_some", prefill_some)
    monkeypatch.setattr(wave, "begin_mixed", begin_mixed)
    return ran


def test_a_wave_out_of_device_memory_is_split_and_answers_as_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = engine.loop
    requests = [engine.make_request(prompt=f"w{i} w{i + 3} w9", n=4) for i in range(6)]
    want = [engine.generate([r])[0] for r in requests]
    ran = _prefill_runs_out_of_memory_over(engine, monkeypatch, 2)
    handles = [loop.submit(r) for r in requests]
    finish_and_compare(loop, handles, want)
    assert ran and max(ran) <= 2 and sum(ran) == 6, ran
    assert_idle(engine)


def test_a_wave_out_of_device_memory_beside_others_is_halved_not_retried_whole(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waves in flight keep their memory until they end, so the retry of a prefill that
    ran out of memory beside them is smaller, not the same wave again every iteration (each
    failed attempt costs the GPU time up to its failure); /metrics counts the retries."""
    loop = engine.loop
    first = engine.make_request(prompt="w1 w2", n=4)
    requests = [engine.make_request(prompt=f"w{i} w{i + 5} w8", n=4) for i in range(4)]
    want = [engine.generate([r])[0] for r in [first, *requests]]
    before = loop.stats().admission_retries_memory
    handles = [loop.submit(first)]
    loop.run_once()  # first is in flight
    ran = _prefill_runs_out_of_memory_over(engine, monkeypatch, 2)
    handles += [loop.submit(r) for r in requests]
    loop.run_once()  # a prefill of 4 beside the wave in flight: out of memory
    assert loop.stats().admission_retries_memory == before + 1
    loop.run_once()
    assert ran == [2], "the retry beside the wave in flight takes half"
    finish_and_compare(loop, handles, want)
    assert loop.stats().admission_retries_memory == before + 1
    assert_idle(engine)


def test_a_request_out_of_device_memory_alone_fails_with_what_to_change(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = engine.loop
    _prefill_runs_out_of_memory_over(engine, monkeypatch, 0)
    request = engine.make_request(prompt="w1 w2 w3", n=4)
    handle = loop.submit(request)
    while not handle.future.done():
        loop.run_once()
    named = rf"{len(request.prompt_ids)}-token prompt, n=4\).*lower n"
    with pytest.raises(DeviceMemoryError, match=named) as info:
        handle.future.result(timeout=0)
    assert (info.value.param, info.value.retry) == ("n", False)
    monkeypatch.undo()
    [result] = engine.generate([engine.make_request(prompt="w1 w2 w3", n=4)])
    assert len(result.choices) == 4, "the engine keeps serving"
    assert_idle(engine)


def test_a_beam_step_out_of_device_memory_fails_its_wave_only(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = engine.loop
    wave, real = engine.wave, engine.wave.advance
    first = loop.submit(engine.make_request(prompt="w1 w2", n=8))
    loop.run_once()  # first is in flight at level 1

    def advance(state) -> None:
        if len(state.requests) == 1 and state.requests[0] is first.request:
            raise torch.OutOfMemoryError("CUDA out of memory (a beam step)")
        real(state)

    monkeypatch.setattr(wave, "advance", advance)
    second = loop.submit(engine.make_request(prompt="w4 w5", n=4))
    while not (first.future.done() and second.future.done()):
        loop.run_once()
    with pytest.raises(DeviceMemoryError, match="beam step of 1 requests") as info:
        first.future.result(timeout=0)
    assert info.value.retry, "beside other waves: may fit later (the server says 503)"
    assert len(second.future.result(timeout=0).choices) == 4
    assert_idle(engine)


def test_waves_group_one_width_and_keep_arrival_order(engine: Engine) -> None:
    loop = engine.loop
    widths = [4, 8, 4, 8, 4]
    before = loop.stats()
    handles = [
        loop.submit(engine.make_request(prompt=f"w{i} w3", n=n)) for i, n in enumerate(widths)
    ]
    loop.run_once()
    # the oldest request's width (4) forms the first wave: the three n=4 requests
    assert [h.admitted_at is not None for h in handles] == [True, False, True, False, True]
    after = loop.stats()
    assert after.waves_admitted - before.waves_admitted == 1
    assert after.requests_admitted - before.requests_admitted == 3
    assert after.busy_seconds > before.busy_seconds
    results = engine.generate([h.request for h in handles])  # the same requests, offline
    finish_and_compare(loop, handles, results)
    assert_idle(engine)


def test_a_failing_iteration_fails_its_requests_and_the_thread_keeps_serving(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(checkpoint)
    loop = engine.loop
    loop.start()
    try:

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated result assembly bug")

        monkeypatch.setattr("flashrec_core.engine.loop.assemble_results", broken)
        handle = loop.submit(engine.make_request(prompt="w1 w2", n=4))
        with pytest.raises(RuntimeError, match="simulated"):
            handle.future.result(timeout=30)
        monkeypatch.undo()
        [result] = engine.generate([engine.make_request(prompt="w1 w2", n=4)])
        assert len(result.choices) == 4
    finally:
        loop.stop(grace_s=5)
    assert_idle(engine)


def test_background_thread_serves_and_stops(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop thread serves with the intra-op threads it is given (`flashrec serve` loads with
    one and hands the machine's to the engine thread: a per-thread OpenMP setting, so the loop
    thread sets it itself), carries its name in the OS too (Linux: top -H, /proc), then stops
    and admits nothing more."""
    engine = make_engine(checkpoint)
    loop, seen, names = engine.loop, [], []
    real = loop.run_once

    def run_once() -> None:
        seen.append(torch.get_num_threads())
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        names.append(comm.read_text().strip() if comm.exists() else None)
        real()

    monkeypatch.setattr(loop, "run_once", run_once)
    wanted = 1 if torch.get_num_threads() > 1 else 2
    loop.intra_op_threads = wanted
    loop.start()
    try:
        [result] = engine.generate([engine.make_request(prompt="w1 w2", n=4)])
        assert len(result.choices) == 4
    finally:
        loop.stop(grace_s=5)
    assert seen and set(seen) == {wanted}, seen
    if sys.platform == "linux":
        assert set(names) == {"flashrec-engine"}, names
    assert not loop.running
    with pytest.raises(EngineStoppedError):
        loop.submit(engine.make_request(prompt="w1", n=2))


def test_generate_drives_the_loop_with_the_host_threads_and_puts_them_back(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a loop thread, `Engine.generate` drives the loop on the caller's thread with
    EngineConfig.host_threads intra-op threads for that long, and restores the caller's count
    (on CPU the default leaves them as they are)."""
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    engine = make_engine(checkpoint, host_threads=wanted)
    assert make_engine(checkpoint).loop.intra_op_threads is None  # CPU: torch's default
    seen: list[int] = []
    real = engine.loop.run_once

    def run_once() -> None:
        seen.append(torch.get_num_threads())
        real()

    monkeypatch.setattr(engine.loop, "run_once", run_once)
    try:
        [result] = engine.generate([engine.make_request(prompt="w1 w2", n=4)])
        assert len(result.choices) == 4
        assert seen and set(seen) == {wanted}, seen
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_pool_of_what_the_budgets_can_use_never_runs_short(checkpoint: Path) -> None:
    """The KV pool sized by `workload_kv_tokens` (as CUDA engines are, when it is below their
    memory share) holds every request the budgets let in at once: the request table full of
    longest prompts and the beams of the waves in flight, with no prefix cache to evict."""
    from dataclasses import replace as with_fields

    from flashrec_core.engine.build import workload_kv_tokens

    base = EngineConfig(model_path=str(checkpoint), device="cpu", max_requests=4, max_context=24,
                        max_wave_rows=32, prefix_cache=False, show_progress=False)  # fmt: skip
    budget = workload_kv_tokens(base, max_context=24, sid_depth=3)
    assert budget == 4 * 24 + 2 * 32 * 2 + 1
    cfg = base.model_copy(update={"kv_cache_tokens": budget})
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(checkpoint / "catalog.json")))
    loop = engine.loop
    longest = 24 - engine.trie.depth  # the prompt limit check leaves room for the SID steps
    vocab = engine.vocab_size - 64  # plain tokens, below the SID codebooks
    requests = [
        with_fields(engine.make_request(prompt="w1", n=16), prompt_ids=tuple(
            (7 * i + j) % vocab for j in range(longest)))
        for i in range(18)
    ]  # fmt: skip
    handles = [loop.submit(r, bounded=False) for r in requests]
    while not all(h.future.done() for h in handles):
        loop.run_once()
    assert all(h.future.exception() is None for h in handles), "a request ran short of KV"
    # the steady state reached the budgets' most: depth - 1 waves of 2 requests x 16 beams (the
    # one admitted and the one stepping; the finishing one handed its KV back first), so a full
    # table of longest prompts, and depth - 1 slots for each of their beams
    peak = loop.stats().kv_slots_peak_used
    assert peak == 4 * longest + 2 * 32 * 2
    assert peak <= budget - 1
    assert_idle(engine)


def test_a_future_cancelled_by_its_client_leaves_the_other_requests_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio's wrap_future cancels the engine's future when the client's task is cancelled, at
    any moment from the event loop's thread: here during the wave's last step, after the
    iteration's retire pass. The loop must settle the rest and keep serving."""
    loop = engine.loop
    gone = loop.submit(engine.make_request(prompt="w1 w2 w3", n=8))
    kept = loop.submit(engine.make_request(prompt="w4 w5 w6", n=8))
    step = engine.wave.advance

    def step_then_cancel(state) -> None:  # the client goes away while the last step runs
        step(state)
        if state.level == engine.wave.depth:
            assert gone.future.cancel(), "a pending concurrent future can be cancelled"

    monkeypatch.setattr(engine.wave, "advance", step_then_cancel)
    while not kept.future.done():
        loop.run_once()
    monkeypatch.undo()
    [alone] = engine.generate([kept.request])
    assert_same_ranking(ranking(kept.future.result()), ranking(alone), ATOL_SAME_ENGINE)
    assert gone.future.cancelled()
    assert_idle(engine)


def test_call_runs_on_the_engine_thread_and_returns_or_raises(checkpoint: Path) -> None:
    """Device work outside requests (graph capture at warm-up) runs on the thread that owns the
    device, between steps; without a thread it runs in the caller."""
    import threading

    engine = make_engine(checkpoint)
    loop = engine.loop
    assert loop.call(lambda: threading.current_thread().name) == threading.current_thread().name
    loop.start()
    try:
        assert loop.call(lambda: threading.current_thread().name) == "flashrec-engine"

        def broken() -> None:
            raise ValueError("task failed")

        with pytest.raises(ValueError, match="task failed"):
            loop.call(broken)
        [result] = engine.generate([engine.make_request(prompt="w1 w2", n=4)])  # still serving
        assert len(result.choices) == 4
    finally:
        loop.stop(grace_s=5)
    assert_idle(engine)


def test_warm_up_out_of_device_memory_caps_the_wave_budget_instead_of_failing(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's warm-up, largest wave first: a beam step that runs out of device memory (a
    CUDA graph's capture failed and so did the eager step, as on an 80 GB card at 0.85 of its
    memory for the KV pool) lowers the loop's beam-row budget to the next count down; the
    smaller waves warm up, and later traffic forms waves within the new budget. The smallest
    count failing still fails the warm-up."""
    from flashrec_core.server.warmup import warm_ladder

    engine = make_engine(checkpoint)
    wave, real = engine.wave, engine.wave.advance
    most = 2  # requests a beam step has device memory for

    def advance(state) -> None:
        if len(state.requests) > most:
            raise torch.OutOfMemoryError("CUDA out of memory (a beam step)")
        real(state)

    monkeypatch.setattr(wave, "advance", advance)
    request = engine.make_request(prompt="w1 w2", n=4)
    done: list[int] = []
    warm_ladder(engine, request, [4, 3, 2, 1], lambda: done.append(1))
    assert len(done) == 4, "every count is accounted for on the progress bar"
    assert engine.loop.limits.max_wave_rows == 2 * 4, "4 failed, then 3: capped at 2 requests"
    results = engine.generate([engine.make_request(prompt=f"w{i}", n=4) for i in range(5)])
    assert [len(r.choices) for r in results] == [4] * 5, "waves of at most 2 requests"
    assert_idle(engine)
    most = 0
    with pytest.raises(DeviceMemoryError, match="beam step of 1 requests"):
        warm_ladder(engine, request, [1], lambda: None)
    assert_idle(engine)
