"""Does the Triton prefill (or the fresh one) score beams like FlashInfer's prefill? (GPU
diagnosis of the GPU tier's beam-search parity test, tests/gpu/test_gpu_engine.py, with the
prefill paths side by side.)

For every architecture, the test's tiny checkpoint, prompt and catalogs: the worst |engine
log-prob - fp32 transformers log-prob| over the returned beams, per n, beam-step attention and
prefill attention, next to the test's bound (twice the CPU torch path's worst error + 0.02), and
after a slash the same bound measured like for like: the CPU torch path scoring exactly the GPU's
beams (a catalog of those SIDs, searched at width n, returns every one of them). Over an FP8
cache a row runs the Triton beam kernel with its experimental FP8 score dot
(`--fp8-attention-scores`). A last row takes the experimental fresh prefill
(`--prefill-attention fresh`: the prompt's own K/V unrounded), its like-for-like bound from the
CPU engine's fresh prefill, which rounds where it does.
Usage: python scripts/diagnose_prefill_accuracy.py [OUT_DIR] [--quantization fp8|none]
"""

from __future__ import annotations

import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import teacher_forced_logprob

PROMPT = "user history w1 w7 w3 item w9"
WIDTHS = (4, 16, 64)


def _worst(engine: Engine, hf, n: int) -> tuple[float, dict]:
    req = engine.make_request(prompt=PROMPT, n=n)
    [res] = engine.generate([req])
    exact = partial(teacher_forced_logprob, hf, req.prompt_ids, engine.layout)
    errors = {c.codes: abs(c.logprob - exact(c.codes)) for c in res.choices}
    return max(errors.values()), errors


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else Path(".")
    quant = "none" if "none" in sys.argv else "fp8"
    kv = "fp8_e4m3" if quant == "fp8" else "bfloat16"
    lines = [f"quantization {quant}; worst |engine - fp32| per n {WIDTHS}"]
    print(lines[0], flush=True)
    for arch in Registry.discover().architectures():
        spec = Registry.discover().resolve(arch)
        path = Path(tempfile.mkdtemp())
        hf = write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
        catalogs = {
            n: write_catalog(path / f"c{n}.json", random_codes(400, seed=n)) for n in WIDTHS
        }

        def engine(device: str, n: int, path: Path = path, catalogs: dict = catalogs, **over):
            cfg = EngineConfig(
                model_path=str(path), device=device, dtype="bfloat16", quantization=quant,
                kv_cache_dtype=kv, show_progress=False, kv_cache_tokens=1 << 16, **over,
            )  # fmt: skip
            return Engine.from_config(cfg, SearchConfig(catalog_path=str(catalogs[n])))

        bounds = [2 * _worst(engine("cpu", n), hf, n)[0] + 0.02 for n in WIDTHS]
        lines.append(f"{arch:24s} test bound            " + "  ".join(f"{b:.3f}" for b in bounds))
        print(lines[-1], flush=True)
        paths = [(b, p, False) for b in ("cascade", "triton") for p in ("backend", "triton")]
        if kv == "fp8_e4m3":
            paths.append(("triton", "triton", True))
        paths.append(("triton", "fresh", False))
        for beam, prefill, fp8_scores in paths:
            cells = []
            for n in WIDTHS:
                w, errors = _worst(
                    engine("cuda", n, beam_attention=beam, prefill_attention=prefill,
                           fp8_attention_scores=fp8_scores), hf, n,
                )  # fmt: skip
                torch.cuda.empty_cache()
                same = write_catalog(path / f"same{n}.json", sorted(errors))
                cpu_prefill = "fresh" if prefill == "fresh" else "auto"
                cpu = engine("cpu", n, catalogs={n: same}, prefill_attention=cpu_prefill)
                alike = 2 * _worst(cpu, hf, n)[0] + 0.02
                flag = ("!" if w >= bounds[WIDTHS.index(n)] else " ") + ("!" if w >= alike else " ")
                cells.append(f"{w:.3f}{flag}/{alike:.3f}")
            label = f"beam {beam:7s} prefill {prefill:7s}" + (" fp8 scores" if fp8_scores else "")
            lines.append(f"{arch:24s} {label} " + "  ".join(cells))
            print(lines[-1], flush=True)
    (out / f"diagnose_prefill_accuracy_{quant}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
