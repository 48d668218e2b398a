"""CPU time to build one n-choice response body (`server/responses.py`) with a catalog of N
items loaded, with the cyclic collector on, with the heap frozen (what `flashrec serve` does
after warm-up, engine/heap.py) and with the collector off.

Usage: python3 scripts/bench_response_build.py [--items 1000000] [-n 512] [--repeats 200]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from flashrec_core.engine.requests import GenerationResult, ResultDecoder
from flashrec_core.search.catalog import build_catalog
from flashrec_core.search.sid_layout import SidLayout
from flashrec_core.server import responses

LEVELS = (8192, 8192, 8192)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("-n", type=int, default=512)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    codes = rng.integers(0, LEVELS[0], size=(args.items, len(LEVELS)))
    catalog = build_catalog(codes, [(f"item{i}",) for i in range(args.items)], LEVELS)
    starts = tuple(1000 + sum(LEVELS[:i]) for i in range(len(LEVELS)))
    decoder = ResultDecoder(SidLayout(("a", "b", "c"), starts, LEVELS), catalog, 0.0)
    rows = rng.choice(len(catalog.codes), args.n, replace=False)
    scores = -np.sort(rng.random(args.n).astype(np.float32))
    levels = rng.random((args.n, len(LEVELS))).astype(np.float32)
    result = GenerationResult(catalog.codes[rows], scores, rows.astype(np.int64), 1024, args.n,
                              decoder, level_logprobs=levels)  # fmt: skip

    def build(label: str) -> None:
        kept = []  # a few bodies alive at once, as under load
        start = time.perf_counter()
        for _ in range(args.repeats):
            kept.append(responses.completion("cmpl-x", "m", [result]))
            kept = kept[-20:]
        ms = 1e3 * (time.perf_counter() - start) / args.repeats
        print(f"{label:>14}: {ms:.2f} ms per {args.n}-choice body ({args.items} catalog items)")

    build("collector on")
    gc.collect()
    gc.freeze()
    build("heap frozen")
    gc.unfreeze()
    gc.disable()
    build("collector off")
    gc.enable()


if __name__ == "__main__":
    main()
