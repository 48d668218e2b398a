"""Keeping CPython's cyclic garbage collector off the long-lived heap of a loaded engine.

A collection of the oldest generation walks every tracked object, holding the GIL: in a served
engine that is torch's and the tokenizer's Python objects and the catalog's item tuples (one per
SID, a million for a 1M-item catalog), none of which will ever be garbage. Allocation-heavy work
(building a 512-choice response, the engine thread's per-step bookkeeping) triggers such
collections every few milliseconds, and the thread that triggers one stalls for the walk, and so
does every other thread waiting for the GIL. Measured on the CPU machine
(`scripts/bench_response_build.py`): one 512-choice response body took 3.4 ms to build with a
1M-item catalog loaded, 1.0 ms with that heap frozen, 0.7 ms with the collector off.

`gc.freeze()` moves every object alive now to a permanent generation that collections skip;
reference counting still frees those objects when their last reference goes, so a replaced
catalog (its tuples, arrays and dicts hold no reference cycles) is freed as before. What a freeze
would keep forever is cyclic garbage that exists at the moment of freezing, which is why the
first freeze collects first.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("flashrec")


def freeze_long_lived(collect: bool = True) -> None:
    """Freeze every object alive now (after start-up, or after loading a catalog). `collect`:
    run a full collection first (a pause: do it before serving; a catalog reload under traffic
    skips it, freezing at most the cyclic garbage of the requests in flight)."""
    start = time.perf_counter()
    if collect:
        gc.collect()
    gc.freeze()
    logger.debug(
        "froze %d long-lived objects in %.0f ms", gc.get_freeze_count(),
        1e3 * (time.perf_counter() - start),
    )  # fmt: skip


def set_young_threshold(allocations: int) -> None:
    """Collect the youngest generation every `allocations` net allocations of tracked objects
    (the older generations' thresholds unchanged). A server's requests in flight live tens of
    milliseconds to seconds: at CPython's 700 each is seen by young collections while alive,
    promoted, and walked again by every older collection until it ends; measured on the CPU
    machine (400 in flight, `flashrec_gc_pause_seconds`), 800 requests cost 111-172 ms of
    collections at 700, 39 ms at 10,000 (8 young ones, no older one) and 15 ms at 50,000 (one
    young collection of 15 ms: a long pause). Garbage cycles wait longer to be freed, which at
    these sizes is a few MB."""
    gc.set_threshold(allocations, *gc.get_threshold()[1:])


@contextmanager
def frozen_heap() -> Iterator[None]:
    """`freeze_long_lived` for the block only (a batch run or a benchmark inside a process that
    goes on, such as a test session): the frozen objects return to the collector after it."""
    freeze_long_lived()
    try:
        yield
    finally:
        gc.unfreeze()
