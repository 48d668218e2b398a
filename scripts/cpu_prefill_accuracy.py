"""Does attending over a prompt's own unrounded K/V (`--prefill-attention fresh`) change how
well an FP8 engine scores beams? The CPU engine's two prefills side by side, no GPU needed.

For every installed architecture: the GPU tier's tiny checkpoint, a few prompts, width n, FP8
W8A8 weights and an FP8 KV cache; the mean and worst |engine log-prob - fp32 transformers
teacher-forced log-prob| over every returned beam, with the default prefill (which reads the
prompt's K/V back from the FP8 pool) and with the fresh one (own K/V unrounded; beam steps read
the pool in both). The torch reference paths round where the GPU paths do, but the CPU's float
kernels differ from the GPU's, so this says whether the fresh numerics cost accuracy, not what a
GPU will measure. Usage: python scripts/cpu_prefill_accuracy.py [-n 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import teacher_forced_logprob

PROMPTS = (
    "user history w1 w7 w3 item w9",
    "w2 w2 w5 item w1 w8 w3",
    "user w9 w4",
    "history item w6 w1 w1 w7 w2 w5 w3",
)


def _errors(path: Path, catalog: Path, hf, n: int, prefill: str) -> list[float]:
    cfg = EngineConfig(
        model_path=str(path), device="cpu", dtype="bfloat16", quantization="fp8",
        kv_cache_dtype="fp8_e4m3", show_progress=False, kv_cache_tokens=1 << 16,
        prefill_attention=prefill,
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))
    errors = []
    for prompt in PROMPTS:
        req = engine.make_request(prompt=prompt, n=n)
        [res] = engine.generate([req])
        exact = partial(teacher_forced_logprob, hf, req.prompt_ids, engine.layout)
        errors += [abs(c.logprob - exact(c.codes)) for c in res.choices]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=16, help="beam width")
    n = parser.parse_args().n
    print(f"FP8, n={n}, {len(PROMPTS)} prompts: |engine - fp32| mean / worst over the beams")
    print(f"{'architecture':24s} {'default prefill':>18s} {'fresh prefill':>18s}")
    registry = Registry.discover()
    for arch in registry.architectures():
        path = Path(tempfile.mkdtemp())
        shape = gpu_shape(registry.resolve(arch).examples[0].hf_config)
        hf = write_tiny_checkpoint(path, shape, level_sizes=LEVELS)
        catalog = write_catalog(path / "catalog.json", random_codes(400, seed=n))
        cells = []
        for prefill in ("auto", "fresh"):
            errors = _errors(path, catalog, hf, n, prefill)
            cells.append(f"{statistics.mean(errors):8.3f} / {max(errors):6.3f}")
        print(f"{arch:24s} {cells[0]:>18s} {cells[1]:>18s}", flush=True)


if __name__ == "__main__":
    main()
