"""The embedded default GenRec model, shipped as package data (never downloaded or rebuilt at
install): a small checkpoint of the recipe's default architecture built by `flashrec recipe build --synthetic` from the built-in
synthetic food-ordering log, with its SID catalog and item names. docs/recipe.md has its figures
and the command that rebuilds it bit for bit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
CATALOG_FILE = "catalog.json"

__all__ = ["DEFAULT_MODEL_DIR", "default_catalog_path", "default_model_path", "with_default_model"]


def default_model_path() -> Path:
    """The embedded checkpoint directory; FileNotFoundError when this install lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from this installation ({DEFAULT_MODEL_DIR} "
            f"has no config.json); reinstall flashrec-core or pass --model-path DIR"
        )
    return DEFAULT_MODEL_DIR


def default_catalog_path() -> Path:
    return default_model_path() / CATALOG_FILE


def with_default_model(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of the parsed CLI args with the embedded model (and its catalog, unless --catalog
    is given) filled in when --model-path was not; says so on stderr."""
    if args.model_path is not None:
        return args
    path = default_model_path()
    print(
        f"flashrec: no --model-path given; using the embedded default model ({path}): a small "
        f"GenRec model of a synthetic food-ordering log; the prompt is item ids, oldest first",
        file=sys.stderr,
    )
    catalog = args.catalog if getattr(args, "catalog", None) else str(path / CATALOG_FILE)
    return argparse.Namespace(**{**vars(args), "model_path": str(path), "catalog": catalog})
