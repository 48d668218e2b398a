"""The frozen heap: collections skip what was alive at the freeze, reference counting still
frees it, and a block's freeze is undone after it."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from flashrec_core.engine.heap import frozen_heap
from flashrec_core.search.catalog import build_catalog


def _catalog(n: int):
    codes = np.stack([np.arange(n) // 64, np.arange(n) % 64], axis=1)
    return build_catalog(codes, [(f"item{i}",) for i in range(n)], (64, 64))


def test_a_catalog_frozen_then_dropped_is_freed_by_reference_counting() -> None:
    catalog = _catalog(4096)
    ref = weakref.ref(catalog)
    with frozen_heap():
        assert gc.get_freeze_count() > 4096, "the catalog's item tuples are frozen"
        del catalog
        assert ref() is None, "a replaced catalog holds no cycles: freed without a collection"
    assert gc.get_freeze_count() == 0


def test_collections_skip_the_frozen_objects() -> None:
    keep = [(i,) for i in range(50_000)]  # tracked tuples, like a catalog's items
    with frozen_heap():
        gc.collect()
        tracked = len(gc.get_objects())
        assert tracked < 50_000, f"{tracked} objects still tracked beside the frozen ones"
    assert len(gc.get_objects()) > 50_000
    del keep
