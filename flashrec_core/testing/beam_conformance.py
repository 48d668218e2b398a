"""Beam-search part of the conformance suite: the engine's constrained search vs transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.spec import ExampleConfig, ModelSpec
from flashrec_core.testing.checkpoint import BASE_WORDS
from flashrec_core.testing.hf_beam import (
    assert_same_ranking,
    hf_beam_search,
    teacher_forced_logprob,
)

LEVELS = (16, 16, 16)
PROMPTS = ("user history w1 w7 w3 item w9", "w12 w40 next")
ATOL_LOGPROB = 1e-4
"""fp32 engine vs fp32 transformers, summed over 3 levels: logits agree to ~1e-6 (prefill
parity), so 1e-4 on a cumulative log-prob leaves two orders of margin."""
ATOL_SAME_ENGINE = 1e-5
"""One fp32 engine, the same request in two batch compositions: only GEMM blocking and reduction
order change, measured under 2e-6 on a 3-level log-prob; 1e-5 bounds that with 5x margin and is
still 100x below the gap between distinct beams that a real bug produces."""


def long_text_prompt(config: Any) -> str:
    """A prompt of more words (one token each) than any sliding window the config declares."""
    window = config.max_sliding_window() if hasattr(config, "max_sliding_window") else None
    words = max(24, (window or 0) + 9)
    return " ".join(BASE_WORDS[(i * 7) % len(BASE_WORDS)] for i in range(words))


def write_catalog(path: Path, codes: list[tuple[int, ...]]) -> Path:
    path.write_text(json.dumps({",".join(map(str, c)): f"item-{i}" for i, c in enumerate(codes)}))
    return path


def random_codes(count: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    codes: set[tuple[int, ...]] = set()
    while len(codes) < count:
        codes.add(tuple(rng.randrange(k) for k in LEVELS))
    return sorted(codes)


def create_engine(
    path: Path, catalog: Path | None, engine: dict[str, Any] | None = None, **search: Any
) -> Engine:
    """A CPU engine on `path` (`engine`: further EngineConfig fields; `search`: SearchConfig's)."""
    cfg = EngineConfig(
        model_path=str(path), device="cpu", kv_cache_tokens=1 << 15, show_progress=False,
        **(engine or {}),
    )  # fmt: skip
    return Engine.from_config(
        cfg, SearchConfig(catalog_path=str(catalog) if catalog else None, **search)
    )


def _ranked(result: Any) -> list[tuple[tuple[int, ...], float]]:
    return [(c.codes, c.logprob) for c in result.choices]


class BeamSearchConformance:
    spec: ClassVar[ModelSpec]

    @pytest.mark.parametrize("normalization", ["level", "sid"])
    @pytest.mark.parametrize("n", [1, 4, 16, 64])
    def test_beam_search_matches_transformers(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path, n: int, normalization: str
    ) -> None:
        path, hf = tiny_checkpoint(self.spec, example, LEVELS)
        catalog = write_catalog(tmp_path / "catalog.json", random_codes(400, seed=n))
        engine = create_engine(path, catalog, sid_normalization=normalization)
        prompts = (*PROMPTS, long_text_prompt(engine.runner.config))
        requests = [engine.make_request(prompt=p, n=n) for p in prompts]
        for req, res in zip(requests, engine.generate(requests)):
            got = [(c.codes, c.logprob) for c in res.choices]
            ref = hf_beam_search(
                hf, req.prompt_ids, n, engine.layout, engine.catalog.codes, normalization
            )
            assert_same_ranking(got, ref, ATOL_LOGPROB)

    def test_never_returns_an_invalid_sid(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        path, _ = tiny_checkpoint(self.spec, example, LEVELS)
        codes = random_codes(60, seed=7)  # sparse: most random continuations are invalid
        engine = create_engine(path, write_catalog(tmp_path / "c.json", codes))
        valid = set(codes)
        rng = random.Random(0)
        prompts = [" ".join(rng.choices(BASE_WORDS, k=rng.randint(1, 12))) for _ in range(500)]
        returned = invalid = 0
        for start in range(0, len(prompts), 100):
            reqs = [engine.make_request(prompt=p, n=8) for p in prompts[start : start + 100]]
            for res in engine.generate(reqs):
                assert len(res.choices) == 8
                returned += len(res.choices)
                invalid += sum(c.codes not in valid for c in res.choices)
        assert returned == 4000 and invalid == 0, f"{invalid} invalid of {returned}"
        runner = engine.runner
        cached = runner.prefix_cache.num_cached if runner.prefix_cache is not None else 0
        assert runner.allocator.num_free + cached == runner.allocator.num_slots - 1, "slot leak"

    @pytest.mark.parametrize("kind", ["single-item", "single-child-chains", "fewer-items-than-n"])
    def test_small_catalogs_return_every_item_exactly(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path, kind: str
    ) -> None:
        """With n >= catalog size beam search keeps every item: ranks and log-probs must equal
        exhaustive teacher-forced scoring by transformers."""
        path, hf = tiny_checkpoint(self.spec, example, LEVELS)
        codes = {
            "single-item": [(3, 14, 1)],
            "single-child-chains": [(a, (a * 5) % 16, (a * 7 + 3) % 16) for a in (0, 4, 9, 15)],
            "fewer-items-than-n": random_codes(10, seed=3),
        }[kind]
        engine = create_engine(path, write_catalog(tmp_path / "c.json", codes))
        req = engine.make_request(prompt=PROMPTS[0], n=16)
        [res] = engine.generate([req])
        expected = sorted(
            ((c, teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c)) for c in codes),
            key=lambda x: -x[1],
        )
        assert_same_ranking([(c.codes, c.logprob) for c in res.choices], expected, ATOL_LOGPROB)
        assert res.notes and f"only {len(codes)} valid items" in res.notes[0]
        item_of = {c: f"item-{i}" for i, c in enumerate(codes)}
        assert all(ch.items == (item_of[ch.codes],) for ch in res.choices)

    def test_mixed_widths_in_one_wave_equal_separate_runs(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        path, _ = tiny_checkpoint(self.spec, example, LEVELS)
        engine = create_engine(path, write_catalog(tmp_path / "c.json", random_codes(300, 1)))
        reqs = [engine.make_request(prompt=p, n=n) for p, n in zip(PROMPTS * 2, (3, 16, 1, 7))]
        together = engine.generate(reqs)
        for req, res in zip(reqs, together):
            [alone] = engine.generate([req])
            assert_same_ranking(_ranked(res), _ranked(alone), ATOL_SAME_ENGINE, ATOL_SAME_ENGINE)

    def test_padded_waves_equal_unpadded(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        """Pad requests (how CUDA-graph shapes are filled) never change a real request's beams."""
        path, _ = tiny_checkpoint(self.spec, example, LEVELS)
        engine = create_engine(path, write_catalog(tmp_path / "c.json", random_codes(300, 2)))
        reqs = [engine.make_request(prompt=p, n=6) for p in PROMPTS[:2]]
        plain = engine.generate(reqs)
        with engine.wave.eager_steps(pad_to=lambda widths: len(widths) + 3):
            padded = engine.generate(reqs)
        for a, b in zip(plain, padded):
            assert_same_ranking(_ranked(b), _ranked(a), ATOL_SAME_ENGINE, ATOL_SAME_ENGINE)

    def test_merged_steps_equal_separate_runs(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        """Waves at different levels stepping through one forward (merge_beam_steps), one
        prompt longer than any sliding window (each request's window cut follows its own
        level): every answer ranks as the same request served alone."""
        path, _ = tiny_checkpoint(self.spec, example, LEVELS)
        catalog = write_catalog(tmp_path / "c.json", random_codes(300, 4))
        engine = create_engine(path, catalog, {"merge_beam_steps": True})
        prompts = (*PROMPTS, long_text_prompt(engine.runner.config))
        reqs = [engine.make_request(prompt=p, n=n) for p, n in zip(prompts, (5, 8, 3))]
        loop, handles = engine.loop, []
        for req in reqs:  # one admission per iteration: the waves in flight are at levels 1, 2
            handles.append(loop.submit(req))
            loop.run_once()
        while not all(h.future.done() for h in handles):
            loop.run_once()
        stats = loop.stats()
        assert stats.beam_forwards < stats.beam_steps, "no two waves shared a forward"
        for req, h in zip(reqs, handles):
            [alone] = engine.generate([req])
            got = _ranked(h.future.result())
            assert_same_ranking(got, _ranked(alone), ATOL_SAME_ENGINE, ATOL_SAME_ENGINE)

    def test_sampling_is_seeded_and_valid(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        path, _ = tiny_checkpoint(self.spec, example, LEVELS)
        codes = random_codes(300, 2)
        engine = create_engine(path, write_catalog(tmp_path / "c.json", codes))

        def run(seed: int) -> list[tuple[int, ...]]:
            req = engine.make_request(prompt=PROMPTS[0], n=8, temperature=1.5, seed=seed)
            return [c.codes for c in engine.generate([req])[0].choices]

        first, again, other = run(11), run(11), run(12)
        assert first == again, "same seed must give the same beams"
        assert first != other, "different seeds gave identical samples (noise not applied?)"
        assert set(first) <= set(codes) and len(set(first)) == 8

    def test_unconstrained_decodes_codebook_levels(
        self, example: ExampleConfig, tiny_checkpoint
    ) -> None:
        path, hf = tiny_checkpoint(self.spec, example, LEVELS)
        engine = create_engine(path, None)
        req = engine.make_request(prompt=PROMPTS[1], n=4)
        [res] = engine.generate([req])
        ref = hf_beam_search(hf, req.prompt_ids, 4, engine.layout, None, "level")
        assert_same_ranking([(c.codes, c.logprob) for c in res.choices], ref, ATOL_LOGPROB)
        assert all(c.items == () for c in res.choices)
        assert np.all([len(c.token_ids) == 3 for c in res.choices])
