"""Named catalogs of one engine, each at a current version, swapped atomically.

A `CatalogVersion` is immutable once built: the catalog, its trie (built on the host, moved to
the device by the engine thread the first time a wave uses it, so no other thread touches the
device), the filter index and the result decoder. Requests bind a version when they are made,
so a request in flight finishes on the version it started with while newer requests get the new
one. A version's memory is freed when nothing references it any more: the set drops it at the
swap, and the last wave that used it drops it when it ends (`live` lists versions still
referenced).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flashrec_core.search.catalog import Catalog
from flashrec_core.search.filters import CatalogIndex
from flashrec_core.search.trie import Trie

if TYPE_CHECKING:
    from flashrec_core.engine.requests import ResultDecoder

DEFAULT_CATALOG = "default"


class CatalogNotFoundError(KeyError):
    """No catalog of that name is served; the message lists the served ones."""


@dataclass(eq=False)
class CatalogVersion:
    name: str
    version: int
    catalog: Catalog | None  # None: unconstrained search over the codebooks
    host_trie: Trie
    index: CatalogIndex | None
    decoder: ResultDecoder
    source: str
    loaded_at: float = field(default_factory=time.time)
    retired: bool = False  # replaced or deleted: no new request gets it
    _device_trie: Trie | None = None

    def trie(self, device: torch.device) -> Trie:
        """The trie on `device` (moved there on first use; call it on the engine thread)."""
        if self._device_trie is None:
            self._device_trie = self.host_trie.to(device)
        return self._device_trie

    def drop_device_trie(self) -> None:
        self._device_trie = None

    def describe(self) -> dict[str, Any]:
        catalog = self.catalog
        return {
            "name": self.name,
            "version": self.version,
            "sids": len(catalog) if catalog is not None else None,
            "items": catalog.num_items if catalog is not None else None,
            "device_bytes": self._device_trie.nbytes if self._device_trie is not None else 0,
            "host_bytes": self.host_trie.nbytes,
            "source": self.source,
            "loaded_at": int(self.loaded_at),
            "retired": self.retired,
        }


class CatalogSet:
    """name -> current CatalogVersion; `put` swaps atomically and returns the version it
    replaced."""

    def __init__(self) -> None:
        self._current: dict[str, CatalogVersion] = {}
        self._lock = threading.Lock()
        self._versions = itertools.count(1)
        self._live: weakref.WeakSet[CatalogVersion] = weakref.WeakSet()

    def next_version(self) -> int:
        return next(self._versions)

    def put(self, version: CatalogVersion) -> CatalogVersion | None:
        with self._lock:
            old = self._current.get(version.name)
            self._current[version.name] = version
            self._live.add(version)
            if old is not None:
                old.retired = True
        return old

    def get(self, name: str | None = None) -> CatalogVersion:
        name = name or DEFAULT_CATALOG
        with self._lock:
            found = self._current.get(name)
            if found is None:
                served = ", ".join(sorted(self._current)) or "none"
                raise CatalogNotFoundError(f"no catalog named {name!r}; served: {served}")
            return found

    def remove(self, name: str) -> CatalogVersion:
        if name == DEFAULT_CATALOG:
            raise ValueError("the default catalog cannot be deleted; replace it instead")
        with self._lock:
            if name not in self._current:
                raise CatalogNotFoundError(f"no catalog named {name!r}")
            old = self._current.pop(name)
            old.retired = True
            return old

    def current(self) -> list[CatalogVersion]:
        with self._lock:
            return sorted(self._current.values(), key=lambda v: v.name)

    def live(self) -> list[CatalogVersion]:
        """Every version still referenced (current ones and ones that requests still use)."""
        return sorted(self._live, key=lambda v: (v.name, v.version))
