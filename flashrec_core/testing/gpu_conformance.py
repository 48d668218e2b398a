"""The GPU tier of the conformance suite, inherited by every `ModelConformance` subclass.

Every test is marked `gpu` (skipped without CUDA) and runs the plugin's own examples at a GPU
shape (head_dim 64, which FlashInfer compiles) through each device path, naming the path in its
id and its failure message: FlashInfer prefill / decode / cascade, the Triton beam kernel, CUDA
graphs, BF16 and FP8. An outside plugin runs it with `pytest -m gpu` in its own repository.

Bounds are measured per checkpoint, not assumed: the engine's torch reference path at the same
precision on CPU sets the error a correct device path may have (x2, + slack); a wrong kernel,
plan or slot is off by whole nats.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.spec import ExampleConfig, ModelSpec
from flashrec_core.testing.beam_conformance import (
    LEVELS,
    PROMPTS,
    long_text_prompt,
    random_codes,
    write_catalog,
)
from flashrec_core.testing.checkpoint import GPU_HEAD_DIM, gpu_shape
from flashrec_core.testing.hf_beam import hf_beam_search, teacher_forced_logprob

SLACK = 0.02
"""Added to twice the reference path's own error: the device paths round at other points
(fused kernels once where eager ops round twice; FlashInfer sums in another order)."""
LOGIT_SLACK = 0.02
"""The same, for logits, as a fraction of max |logit|."""


def _gpu_checkpoint(tiny_checkpoint: Any, spec: ModelSpec, example: ExampleConfig):
    return tiny_checkpoint(spec, example, LEVELS, hf_config=gpu_shape(dict(example.hf_config)),
                           tag="-gpu")  # fmt: skip


def _engine(path: Path, catalog: Path | None, device: str, quantization: str, **extra: Any):
    from flashrec_core.engine.engine import Engine

    cfg = EngineConfig(
        model_path=str(path), device=device, dtype="bfloat16", quantization=quantization,
        kv_cache_dtype="fp8_e4m3" if quantization == "fp8" else "bfloat16",
        show_progress=False, kv_cache_tokens=1 << 16, **extra,
    )  # fmt: skip
    return Engine.from_config(
        cfg, SearchConfig(catalog_path=None if catalog is None else str(catalog))
    )


def _scored(
    engine: Any, hf: Any, prompt: str, n: int
) -> list[tuple[tuple[int, ...], float, float]]:
    """(codes, engine log-prob, fp32 transformers teacher-forced log-prob) of every beam."""
    req = engine.make_request(prompt=prompt, n=n)
    [res] = engine.generate([req])
    assert len(res.choices) == n
    exact = partial(teacher_forced_logprob, hf, req.prompt_ids, engine.layout)
    return [(c.codes, c.logprob, exact(c.codes)) for c in res.choices]


class GpuConformance:
    """Mixed into ModelConformance. Each test carries the `gpu` mark itself: a class-level mark
    would be inherited by every test of the subclass."""

    spec: ClassVar[ModelSpec]

    def test_gpu_tier_shape_parses(self, example: ExampleConfig) -> None:
        """Runs on CPU too: the GPU tier re-shapes each example to head_dim 64; a shape the spec
        refuses would fail every GPU test of the example, found only on a CUDA machine."""
        config = self.spec.parse_config(gpu_shape(dict(example.hf_config)))
        assert config.head_dim == GPU_HEAD_DIM, (example.name, config.head_dim)

    @pytest.mark.gpu
    @pytest.mark.parametrize("quantization", ["none", "fp8"])
    def test_gpu_prefill_and_decode_logits_flashinfer(
        self, example: ExampleConfig, tiny_checkpoint, quantization: str
    ) -> None:
        """FlashInfer prefill and decode (flat, no cascade) vs fp32 transformers, as close as
        the torch backend at the same precision on CPU is."""
        from flashrec_core.testing.conformance import prompts_for
        from flashrec_core.testing.oracle import create_runner, engine_decode_logits, hf_logits

        path, hf = _gpu_checkpoint(tiny_checkpoint, self.spec, example)
        common = dict(dtype="bfloat16", quantization=quantization, cascade_attention=False,
                      kv_cache_dtype="fp8_e4m3" if quantization == "fp8" else "bfloat16")  # fmt: skip
        cpu = create_runner(path, device="cpu", attention_backend="torch", **common)
        gpu = create_runner(path, device="cuda", attention_backend="flashinfer", **common)
        prompts, continuations = prompts_for(cpu.config)
        full = [p + c for p, c in zip(prompts, continuations)]
        for what, runner in (("torch (CPU reference)", cpu), ("FlashInfer", gpu)):
            got = engine_decode_logits(runner, prompts, continuations)
            errs = []
            for g, r, c in zip(got, hf_logits(hf, full), continuations):
                ref = r[-len(c) :]
                errs.append(float((g.float().cpu() - ref).abs().max() / ref.abs().max()))
            if runner is cpu:
                bound = 2 * max(errs) + LOGIT_SLACK
            else:
                worst = max(range(len(errs)), key=errs.__getitem__)
                assert errs[worst] <= bound, (
                    f"{what} decode ({quantization}): sequence {worst} ({len(full[worst])} tokens) "
                    f"off by {errs[worst]:.3f} x max|logit| (bound {bound:.3f} from the torch path)"
                )

    @pytest.mark.gpu
    @pytest.mark.parametrize("beam_attention", ["triton", "cascade"])
    @pytest.mark.parametrize("quantization", ["none", "fp8"])
    def test_gpu_beam_search_matches_transformers(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path, quantization: str,
        beam_attention: str,
    ) -> None:  # fmt: skip
        """Every beam (CUDA graphs on) scores like fp32 transformers within the CPU reference
        path's error, and the beams are as good as transformers' beam search's; prompts include
        one longer than any sliding window."""
        path, hf = _gpu_checkpoint(tiny_checkpoint, self.spec, example)
        catalog = write_catalog(tmp_path / "c.json", random_codes(400, seed=5))
        cpu = _engine(path, catalog, "cpu", quantization)
        gpu = _engine(path, catalog, "cuda", quantization, beam_attention=beam_attention)
        route = f"{gpu.runner.attn_backend.name} beam steps, {quantization}, CUDA graphs"
        for prompt in (PROMPTS[0], long_text_prompt(cpu.runner.config)):
            reference = _scored(cpu, hf, prompt, 16)
            tol = 2 * max(abs(ours - exact) for _, ours, exact in reference) + SLACK
            beams = _scored(gpu, hf, prompt, 16)
            for codes, ours, exact in beams:
                assert abs(ours - exact) < tol, (
                    f"{route}: {codes} scored {ours:.4f}, fp32 transformers {exact:.4f} "
                    f"(tol {tol:.3f}); prompt of {len(prompt.split())} words"
                )
            ids = gpu.make_request(prompt=prompt, n=16).prompt_ids
            theirs = hf_beam_search(hf, ids, 16, gpu.layout, gpu.catalog.codes)
            mean = sum(lp for _, lp in theirs) / len(theirs)
            gap = mean - sum(e for _, _, e in beams) / 16
            ref_gap = mean - sum(e for _, _, e in reference) / 16
            assert gap < max(ref_gap, 0.0) + tol, f"{route}: beams worse by {gap:.4f}"

    @pytest.mark.gpu
    def test_gpu_graph_replays_equal_eager_steps(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        path, _ = _gpu_checkpoint(tiny_checkpoint, self.spec, example)
        catalog = write_catalog(tmp_path / "c.json", random_codes(400, seed=6))
        # decode-step graphs only: a prefill graph pads the prompt's rows to a bucket, and GEMMs
        # of another row count round differently (its own tests bound that against transformers)
        graphs = _engine(path, catalog, "cuda", "none", prefill_graph_tokens=0)
        eager = _engine(path, catalog, "cuda", "none", cuda_graphs=False)
        prompt = long_text_prompt(graphs.runner.config)
        [a] = graphs.generate([graphs.make_request(prompt=prompt, n=8)])
        [b] = eager.generate([eager.make_request(prompt=prompt, n=8)])
        assert graphs.wave.graphs is not None and graphs.wave.graphs.stats.replays > 0, (
            "no beam step replayed a CUDA graph"
        )
        got = [(c.codes, c.logprob) for c in a.choices]
        want = [(c.codes, c.logprob) for c in b.choices]
        # same kernels on the same inputs; 1e-4 only absorbs a different split-KV schedule
        # between a graph-mode and an eager plan (fp32 partial sums, merged in another order)
        assert [g[0] for g in got] == [w[0] for w in want], json.dumps([got, want])
        assert max(abs(x[1] - y[1]) for x, y in zip(got, want)) < 1e-4, json.dumps([got, want])
