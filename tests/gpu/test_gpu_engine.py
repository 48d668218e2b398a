"""The engine on CUDA (BF16, FlashInfer, fused Triton kernels) vs transformers on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import hf_beam_search, teacher_forced_logprob

pytestmark = pytest.mark.gpu


ARCHITECTURES = Registry.discover().architectures()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tiny checkpoint of every installed architecture (its spec's first example)."""
    spec = Registry.discover().resolve(request.param)
    path = tmp_path_factory.mktemp(f"gpu-{request.param}")
    hf = write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    return path, hf, spec



# BF16 engine vs FP32 transformers: per-step log-probs differ by ~1e-2 (bf16 keeps 8 bits of
# mantissa; logits ~3 in magnitude); over 3 steps 0.05 bounds it. Rank swaps are allowed only
# between beams whose reference scores are closer than that.
BF16_TOL = 0.05
FP8_TOL = 0.5
"""W8A8 e4m3 (3 mantissa bits): ~5% relative logit error (FP8_REL_L2 in the CPU suite) on
logits of magnitude ~3 gives ~0.15 per step; 0.5 bounds three steps."""


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("n", [4, 16, 64])
def test_gpu_beam_search_matches_transformers(
    checkpoint, tmp_path: Path, n: int, quantization: str
) -> None:
    """Every returned beam is scored like fp32 transformers scores it (within the precision
    tolerance), and any beam transformers keeps that we do not is within 2 x tol of our cut:
    rankings may differ only between near-ties."""
    path, hf, _ = checkpoint
    catalog = write_catalog(tmp_path / "c.json", random_codes(400, seed=n))
    cfg = EngineConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", quantization=quantization,
        show_progress=False, kv_cache_tokens=1 << 16,
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))
    req = engine.make_request(prompt="user history w1 w7 w3 item w9", n=n)
    [res] = engine.generate([req])
    tol = BF16_TOL if quantization == "none" else FP8_TOL
    assert len(res.choices) == n
    exact = {
        c.codes: teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
        for c in res.choices
    }
    for c in res.choices:
        assert abs(c.logprob - exact[c.codes]) < tol, f"{c.codes}: {c.logprob} vs {exact[c.codes]}"
    cut = min(exact.values())
    for codes, ref_lp in hf_beam_search(hf, req.prompt_ids, n, engine.layout, engine.catalog.codes):
        if codes not in exact:
            assert ref_lp < cut + 2 * tol, f"missed {codes} ({ref_lp:.4f}) above our cut {cut:.4f}"


def test_gpu_engine_uses_fused_paths_and_flashinfer(checkpoint) -> None:
    path, _, spec = checkpoint
    cfg = EngineConfig(
        model_path=str(path), device="cuda", show_progress=False, kv_cache_tokens=4096
    )
    engine = Engine.from_config(cfg, SearchConfig())
    assert engine.runner.attn_backend.name == "flashinfer"
    assert set(engine.runner.loaded.context.fused) == {c.name for c in spec.capabilities}
    assert engine.runner.kv_pool.dtype == torch.float8_e4m3fn
    [res] = engine.generate([engine.make_request(prompt="w1 w2", n=8)])
    assert len(res.choices) == 8
