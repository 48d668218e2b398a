"""Kernels launched with programmatic dependent launch (FLASHREC_PDL=1, 2 or 3,
flashrec_kernels/pdl.py) answer as the serialized launches do, through the engine's CUDA graphs
and its eager steps: a kernel that read its inputs before the kernel ahead of it had written
them would change scores. The launches are the same kernels compiled with a wait first, so the
answers must be bitwise equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint

pytestmark = pytest.mark.gpu


def _answers(path: Path, catalog: Path, **fields: object) -> list[list[tuple]]:
    cfg = EngineConfig(
        model_path=str(path), device="cuda", show_progress=False, kv_cache_tokens=1 << 15,
        max_wave_rows=512, **fields,
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))
    # waves of several requests and widths, prompts long enough for several key chunks
    prompts = [" ".join(f"w{(7 * i + j) % 48}" for j in range(40 + 9 * i)) for i in range(6)]
    requests = [engine.make_request(prompt=p, n=(16, 32)[i % 2]) for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    del engine
    torch.cuda.empty_cache()
    return [[(c.codes, c.logprob) for c in r.choices] for r in results]


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_pdl_launches_answer_as_serialized_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str, cuda_graphs: bool
) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(tmp_path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(tmp_path / "c.json", random_codes(400, seed=3))
    fields = {"quantization": quantization, "cuda_graphs": cuda_graphs}
    monkeypatch.delenv("FLASHREC_PDL", raising=False)
    serialized = _answers(tmp_path, catalog, **fields)
    # the premise: two engines without PDL answer bitwise alike
    assert _answers(tmp_path, catalog, **fields) == serialized, "two runs without PDL differ"
    # wait first; and release the next launch right after the wait; and prefetch GEMM weights
    for mode in ("1", "2", "3"):
        monkeypatch.setenv("FLASHREC_PDL", mode)
        assert _answers(tmp_path, catalog, **fields) == serialized, f"FLASHREC_PDL={mode}"
