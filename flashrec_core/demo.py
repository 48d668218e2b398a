"""`flashrec demo`: a tiny random-weight GenRec checkpoint and catalog, made offline.

The model is the first example config of an installed plugin's spec, with random weights drawn
by transformers; the catalog holds random unique SIDs. It exercises every stage of the engine
but recommends nothing meaningful.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flashrec_core.registry import Registry
from flashrec_core.testing.checkpoint import BASE_WORDS, SPECIAL, write_tiny_checkpoint

logger = logging.getLogger("flashrec")


def write_demo(
    out: Path, arch: str | None, level_sizes: Sequence[int], num_items: int, seed: int = 0
) -> Path:
    _check_new_directory(out)
    registry = Registry.discover()
    if arch is None:
        available = [a for p in registry.plugins if p.spec for a in p.architectures]
        if not available:
            raise LookupError("no model plugin is installed; pip install flashrec-models-<family>")
        arch = sorted(available)[0]
    spec = registry.resolve(arch)
    if not spec.examples:
        raise ValueError(f"{arch}'s spec has no example config to build a demo from")
    capacity = int(np.prod(level_sizes))
    if not 0 < num_items <= capacity:
        raise ValueError(f"--items {num_items} must be in 1..{capacity} for levels {level_sizes}")
    hf_config = dict(spec.examples[0].hf_config)
    needed = len(SPECIAL) + len(BASE_WORDS) + sum(level_sizes) + 2
    hf_config["vocab_size"] = max(hf_config["vocab_size"], -(-needed // 64) * 64)
    hf_config["architectures"] = [arch]
    write_tiny_checkpoint(out, hf_config, level_sizes=level_sizes, seed=seed)
    (out / "catalog.json").write_text(json.dumps(_random_catalog(level_sizes, num_items, seed)))
    return out


def _check_new_directory(out: Path) -> None:
    """The demo writes several files: onto a file or into a directory in use it would clobber."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is an existing file; give the path of a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is a directory that is not empty; give a new directory "
            "(or remove this one first)"
        )


def _random_catalog(level_sizes: Sequence[int], num_items: int, seed: int) -> dict[str, str]:
    rng = np.random.default_rng(seed)
    flat = rng.choice(int(np.prod(level_sizes)), size=num_items, replace=False)
    codes = np.stack(np.unravel_index(flat, tuple(level_sizes)), axis=1)
    return {",".join(map(str, row)): f"item-{i:06d}" for i, row in enumerate(codes.tolist())}
