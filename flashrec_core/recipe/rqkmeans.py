"""Residual-quantized k-means: item vectors -> L codes of K each (scikit-learn KMeans per level
on the residual of the levels before), then one rule that makes every item's SID unique.

Collision rules (`--collision`):
- reassign: items sharing all L codes are ranked by distance to their last-level centroid (then
  by item order); the first keeps the SID, each next one takes the nearest last-level centroid
  whose code is still free under the same L-1 prefix. Depth stays L.
- extra-level: an (L+1)-th level numbers the items of each SID 0, 1, ... in that same rank
  order (TIGER's rule); its size is the largest group.
- auto (default): reassign when every prefix has room, else extra-level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

logger = logging.getLogger("flashrec")

CollisionRule = Literal["auto", "reassign", "extra-level"]


class QuantizationError(ValueError):
    """The codebooks cannot give every item a distinct SID under the chosen rule."""


@dataclass(frozen=True)
class SemanticIds:
    codes: np.ndarray  # int64 [num_items, depth], row i = item i
    level_sizes: tuple[int, ...]
    rule: Literal["reassign", "extra-level"]
    collided: int
    """Items whose raw L-level SID was shared with an item ranked before them."""


def residual_kmeans(
    vectors: np.ndarray, levels: int, k: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Codes [n, levels] and the last level's distances to every centroid [n, k]."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    n = vectors.shape[0]
    if n < k:
        raise QuantizationError(
            f"{n} items cannot fill {k} clusters per level; pass a --codebook-size <= {n}"
        )
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    residual = (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float64)
    codes = np.zeros((n, levels), dtype=np.int64)
    dists = np.zeros((n, k))
    with threadpool_limits(limits=1):  # one thread: the same centroids on every machine
        for lvl in range(levels):
            km = KMeans(n_clusters=k, n_init=4, random_state=seed + lvl, algorithm="lloyd")
            codes[:, lvl] = km.fit_predict(residual)
            dists = km.transform(residual)
            residual = residual - km.cluster_centers_[codes[:, lvl]]
    return codes, dists


def quantize(
    vectors: np.ndarray, levels: int, k: int, seed: int, rule: CollisionRule = "auto"
) -> SemanticIds:
    """Unique SIDs for every row of `vectors` (see the module docstring for the rules)."""
    codes, dists = residual_kmeans(vectors, levels, k, seed)
    groups = _groups(codes, dists)
    collided = sum(len(g) - 1 for g in groups)
    if rule in ("auto", "reassign"):
        moved = _reassign(codes, dists, groups)
        if moved is not None:
            return SemanticIds(moved, (k,) * levels, "reassign", collided)
        if rule == "reassign":
            raise QuantizationError(
                f"more than {k} items share an SID prefix, so --collision reassign cannot give "
                f"each a distinct last code; pass --collision extra-level or a larger "
                f"--codebook-size"
            )
        logger.info("rq-kmeans: a prefix is full; resolving collisions with an extra level")
    return _extra_level(codes, groups, k, levels, collided)


def _groups(codes: np.ndarray, dists: np.ndarray) -> list[list[int]]:
    """Items sharing a SID, each group ranked by (distance to own centroid, item index)."""
    own = dists[np.arange(len(codes)), codes[:, -1]]
    _, inverse = np.unique(codes, axis=0, return_inverse=True)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(inverse.ravel().tolist()):
        members.setdefault(g, []).append(i)
    return [sorted(m, key=lambda i: (own[i], i)) for _, m in sorted(members.items()) if len(m) > 1]


def _reassign(codes: np.ndarray, dists: np.ndarray, groups: list[list[int]]) -> np.ndarray | None:
    codes = codes.copy()
    used: dict[tuple[int, ...], set[int]] = {}
    for row in codes.tolist():
        used.setdefault(tuple(row[:-1]), set()).add(row[-1])
    for group in groups:
        for i in group[1:]:
            prefix = tuple(codes[i, :-1].tolist())
            free = [
                c for c in np.argsort(dists[i], kind="stable").tolist() if c not in used[prefix]
            ]
            if not free:
                return None
            codes[i, -1] = free[0]
            used[prefix].add(free[0])
    return codes


def _extra_level(
    codes: np.ndarray, groups: list[list[int]], k: int, levels: int, collided: int
) -> SemanticIds:
    extra = np.zeros((len(codes), 1), dtype=np.int64)
    for group in groups:
        extra[group, 0] = np.arange(len(group))
    size = int(extra.max()) + 1
    return SemanticIds(np.hstack([codes, extra]), (k,) * levels + (size,), "extra-level", collided)
