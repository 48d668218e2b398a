"""The Triton small-row FP8 GEMM inside the engine (EngineConfig.fp8_gemm_triton_rows): which
projections take it, and a whole search through it (the kernel in the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.layers import quant
from flashrec_core.layers.linear import Linear
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_searches_alike

pytest.importorskip("triton")

BEAM_TOL = 0.05
"""Per-beam log-prob gap between the two engines. Each projection differs only by the order of
its fp32 sums and one bf16 rounding of its output (2^-9 relative; tests/kernels/test_fp8_gemm.py
bounds it), the same size of noise as the bf16 attention kernels, over a prefill and three
steps; the same tolerance as those engine comparisons (test_triton_prefill_attention.py)."""


def _engine(path: Path, **settings: object) -> Engine:
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    if not (path / "config.json").exists():
        write_tiny_checkpoint(path, spec.examples[0].hf_config, level_sizes=LEVELS)
        write_catalog(path / "c.json", random_codes(300, seed=5))
    fields: dict[str, object] = {
        "quantization": "fp8", "enable_fused_rms_fp8": False, "enable_fused_silu_fp8": False,
        "enable_fused_qk_rope_kv": False, **settings,
    }  # fmt: skip
    cfg = EngineConfig(
        model_path=str(path), device="cpu", dtype="bfloat16", show_progress=False,
        kv_cache_tokens=4096, **fields,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "c.json")))


def _small_rows(engine: Engine) -> set[int]:
    return {m.small_gemm_rows for m in engine.runner.model.modules() if isinstance(m, Linear)}


def test_searches_through_the_small_row_gemm_match_the_reference_gemm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection of steps of up to 64 rows through the Triton GEMM: the same beams and
    log-probs as the exact-dequant GEMM, within BEAM_TOL; prefills (more rows) keep the other."""
    reference = _engine(tmp_path)
    small = _engine(tmp_path, fp8_gemm_triton_rows=64, triton_on_cpu=True)
    assert _small_rows(reference) == {0} and _small_rows(small) == {64}
    rows_seen: list[int] = []
    real = quant.fp8_gemm

    def counted(a, *args, **kwargs):  # the real kernel, counting the rows it is given
        rows_seen.append(a.shape[0])
        return real(a, *args, **kwargs)

    monkeypatch.setattr(quant, "fp8_gemm", counted)
    assert_searches_alike([reference, small], BEAM_TOL, requests=3, n=6)
    assert rows_seen and max(rows_seen) <= 64, rows_seen


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"triton_on_cpu": False}, "no Triton kernels here"),
        ({"quantization": "none"}, "BF16 weights"),
        ({"fp8_gemm_triton_rows": None}, "the default: no launch table off CUDA"),
    ],
)
def test_the_small_row_gemm_is_off_where_it_cannot_run(
    tmp_path: Path, settings: dict[str, object], why: str
) -> None:
    """Without Triton kernels (a CPU engine outside the interpreter), without FP8 weights, or by
    default without a GPU launch table the projections keep their usual GEMM; the engine runs."""
    engine = _engine(tmp_path, **{"fp8_gemm_triton_rows": 64, "triton_on_cpu": True, **settings})
    assert _small_rows(engine) == {0}, why
    [result] = engine.generate([engine.make_request(prompt="user w1 w2 item", n=4)])
    assert len(result.choices) == 4
