"""Which engine path scores beams unlike fp32 transformers? (GPU diagnosis of eager steps.)

Runs 3 requests of n=8 through fresh tiny-Qwen3 engines that differ in one switch each and prints
each configuration's worst |engine logprob - fp32 transformers logprob| over the returned beams.
Usage: python scripts/diagnose_gpu_search.py [OUT_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import teacher_forced_logprob


def worst_error(engine: Engine, hf, offset: int, pad_to: int | None) -> str:
    """Worst error of the uncached run, then of the same requests with cached prompts."""
    reqs = [engine.make_request(prompt=f"user w{i + offset} w{i + 3} item", n=8) for i in range(3)]
    worst = []
    eager = engine.wave.eager_steps(lambda widths: pad_to) if pad_to is not None else nullcontext()
    with eager:
        for _ in ("uncached", "cached"):
            worst.append(0.0)
            for req, res in zip(reqs, engine.generate(reqs)):
                for c in res.choices:
                    exact = teacher_forced_logprob(hf, req.prompt_ids, engine.layout, c.codes)
                    worst[-1] = max(worst[-1], abs(c.logprob - exact))
    return "  ".join(f"{w:.4f}" for w in worst)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    path = Path(tempfile.mkdtemp())
    hf = write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(path / "c.json", random_codes(400, seed=3))
    base = dict(
        model_path=str(path),
        device=os.environ.get("DEVICE", "cuda"),
        show_progress=False,
        kv_cache_tokens=1 << 15,
        max_wave_rows=256,
        quantization="none",
    )
    cases = [
        ("graphs cascade, prompts 0", {}, 0, None),
        ("graphs cascade, prompts 10", {}, 10, None),
        ("graphs flat, prompts 10", {"cascade_attention": False}, 10, None),
        ("eager cascade, prompts 10", {"cuda_graphs": False}, 10, None),
        ("eager cascade padded 4", {"cuda_graphs": False}, 10, 4),
        ("eager flat", {"cuda_graphs": False, "cascade_attention": False}, 10, None),
        ("eager triton", {"cuda_graphs": False, "beam_attention": "triton"}, 10, None),
        (
            "eager, torch trie top-k",
            {"cuda_graphs": False, "enable_fused_trie_topk": False},
            10,
            None,
        ),
        (
            "eager, no fused qk-rope-kv",
            {"cuda_graphs": False, "enable_fused_qk_rope_kv": False},
            10,
            None,
        ),
        ("eager, no prefix cache", {"cuda_graphs": False, "prefix_cache": False}, 10, None),
        ("eager, torch attention", {"cuda_graphs": False, "attention_backend": "torch"}, 10, None),
        ("graphs, torch trie top-k", {"enable_fused_trie_topk": False}, 10, None),
    ]
    lines = []
    for name, over, offset, pad in cases:
        try:
            engine = Engine.from_config(
                EngineConfig(**base, **over), SearchConfig(catalog_path=str(catalog))
            )
            err = worst_error(engine, hf, offset, pad)
            del engine
        except Exception as exc:  # noqa: BLE001 - a diagnosis reports every case
            err = f"error: {type(exc).__name__}: {exc}"[:300]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        lines.append(f"{name:40s} {err}")
        print(lines[-1], flush=True)
    (out / "diagnose_gpu_search.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
