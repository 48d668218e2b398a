"""A model whose head dim FlashInfer has no kernels for (the CPU tier's tiny models and the
embedded demo model: 16) on CUDA without CUDA graphs: a repeated prompt, whose second prefill is
one token after the cached prefix, runs through the Triton prefill kernel instead of FlashInfer
(which failed on it, session 28) and answers as the first time."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrec_core.attention.triton_prefill import TritonPrefillAttention
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_same_beams_within

pytestmark = pytest.mark.gpu

BEAM_TOL = 0.05
"""Per-beam log-prob gap between a fresh and a cached prefill of one prompt: the cached one
attends in another kernel (Triton prefill, one query) to the same bf16 KV; three levels of
~1e-2 attention noise (tests/core/test_merged_steps.py)."""


def test_a_cached_prompt_prefills_its_last_token_without_flashinfer(tmp_path: Path) -> None:
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    hf_config = spec.examples[0].hf_config
    write_tiny_checkpoint(tmp_path, hf_config, level_sizes=LEVELS)
    catalog = write_catalog(tmp_path / "c.json", random_codes(300, seed=5))
    cfg = EngineConfig(
        model_path=str(tmp_path), device="cuda", dtype="bfloat16", quantization="none",
        kv_cache_dtype="bfloat16", kv_cache_tokens=1 << 13, cuda_graphs=False,
        show_progress=False,
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))
    head_dim = engine.runner.config.head_dim
    assert head_dim not in (64, 128, 256), "a head dim FlashInfer has no kernels for"
    backend = engine.runner.attn_backend
    assert isinstance(backend, TritonPrefillAttention) and backend.one_query, (
        "one-query prefills go to the Triton kernel"
    )
    request = engine.make_request(prompt="user history w1 w2 w3", n=8)
    [first] = engine.generate([request])
    [again] = engine.generate([request])  # all but the last token cached
    assert again.cached_tokens == len(request.prompt_ids) - 1
    got = {c.codes: c.logprob for c in again.choices}
    assert_same_beams_within(got, {c.codes: c.logprob for c in first.choices}, BEAM_TOL)
