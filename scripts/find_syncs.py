"""Where the engine synchronizes the host with the GPU (each sync stops the host from running
ahead, so kernel launches no longer overlap GPU work).

Runs `Engine.generate` on a checkpoint directory under `torch.cuda.set_sync_debug_mode("warn")`
after a warm-up, and counts every synchronizing call by its innermost flashrec_core frame (and
the frame that called it). Usage on the GPU machine:

    python3 scripts/find_syncs.py /tmp/bench-ckpt OUT_DIR [-n 50] [--requests 32]
"""

from __future__ import annotations

import argparse
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from flashrec_core.bench.workload import RequestSpec, synthetic_requests
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine


def _site(stack: list[traceback.FrameSummary]) -> str:
    ours = [f for f in stack if "flashrec_core" in f.filename]
    if not ours:
        return "outside flashrec_core"
    inner = ours[-1]
    caller = ours[-2] if len(ours) > 1 else None
    here = f"{inner.filename.split('flashrec_core/')[-1]}:{inner.lineno} {inner.line}"
    if caller is not None:
        here += f"  <- {caller.filename.split('flashrec_core/')[-1]}:{caller.lineno}"
    return here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    engine = Engine.from_config(
        EngineConfig(model_path=str(ckpt), show_progress=False),
        SearchConfig(catalog_path=str(ckpt / "catalog.json")),
    )
    spec = RequestSpec(args.requests, 1024, 64, args.n)
    for seed in (1, 2):  # warm-up: JIT, graph capture, allocator growth
        engine.generate(synthetic_requests(spec, engine.layout, seed=0, body_seed=seed))
    measured = synthetic_requests(spec, engine.layout, seed=0, body_seed=3)
    sites: Counter[str] = Counter()

    def record(*_: object, **__: object) -> None:  # called inside the synchronizing call
        sites[_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(measured)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"{count:6d}  {site}" for site, count in sites.most_common()]
    text = f"{sum(sites.values())} synchronizing calls in one generate of {args.requests} x n={args.n}\n"
    text += "\n".join(lines) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"syncs_n{args.n}.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
