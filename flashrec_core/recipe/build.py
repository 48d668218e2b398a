"""`flashrec recipe build`: interaction log -> split -> item embeddings -> RQ-k-means SIDs ->
SID catalog with metadata -> tokenizer -> trained checkpoint, all in one directory:

    DIR/config.json, model.safetensors, tokenizer.json, ...   an ordinary HF checkpoint
    DIR/catalog.json                                            {"sids": ..., "items": ...}
    DIR/recipe.json                                             settings, data stats, losses
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashrec_core.recipe.arch import recipe_hf_config, resolve_recipe_arch
from flashrec_core.recipe.config import RecipeConfig
from flashrec_core.recipe.embeddings import (
    cooccurrence_embeddings,
    load_npy_embeddings,
    matrix_factorization_embeddings,
)
from flashrec_core.recipe.interactions import InteractionLog, natural_key
from flashrec_core.recipe.rqkmeans import SemanticIds, quantize
from flashrec_core.recipe.source import describe, load_source
from flashrec_core.recipe.split import leave_last_out
from flashrec_core.recipe.tokenizer import build_recipe_tokenizer

logger = logging.getLogger("flashrec")

RECIPE_FILE = "recipe.json"
CATALOG_FILE = "catalog.json"
MAX_POSITION = 512


@dataclass(frozen=True)
class BuildReport:
    out: Path
    items: int
    users: int
    examples: int
    level_sizes: tuple[int, ...]
    collision_rule: str
    collided: int
    losses: list[float]


def build_recipe(cfg: RecipeConfig, out: str | Path, progress: bool = True) -> BuildReport:
    """Run every stage and write the checkpoint directory `out` (progress: a tqdm bar)."""
    _require_sklearn()
    from flashrec_core.recipe.train import build_model, train, training_examples  # torch
    from flashrec_core.search.sid_layout import infer_sid_layout

    out = Path(out)
    cfg = cfg.model_copy(update={"arch": resolve_recipe_arch(cfg.arch)[0]})
    log = load_source(cfg.source)
    split = leave_last_out(log.sequences)
    items = sorted(log.items, key=natural_key)
    logger.info(
        "recipe: %s: %d users, %d items", describe(cfg.source), len(split.train), len(items)
    )
    sids = quantize(_embeddings(cfg, split.train, items), cfg.levels, cfg.codebook_size,
                    cfg.train.seed, cfg.collision)  # fmt: skip
    tokenizer = build_recipe_tokenizer(items, sids.level_sizes)
    layout = infer_sid_layout(tokenizer.get_vocab())
    examples = training_examples(split.train, items, sids, tokenizer, cfg.max_history)
    arch, spec = resolve_recipe_arch(cfg.arch)  # resolved above: recipe.json names it
    hf_config = recipe_hf_config(spec, arch, cfg.model, len(tokenizer), MAX_POSITION, tokenizer)
    model = build_model(hf_config, cfg.train.seed)
    losses = train(model, examples, layout, cfg.train, progress)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_sid_catalog(out / CATALOG_FILE, items, sids, log)
    report = BuildReport(out, len(items), len(split.train), len(examples), sids.level_sizes,
                         sids.rule, sids.collided, losses)  # fmt: skip
    _write_recipe_json(out / RECIPE_FILE, cfg, report)
    return report


def _require_sklearn() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "flashrec recipe build needs scikit-learn (k-means, SVD): pip install "
            "'flashrec-core[recipe]'"
        ) from None


def _embeddings(cfg: RecipeConfig, train_seqs: dict, items: list[str]) -> np.ndarray:
    seed = cfg.train.seed
    if cfg.embeddings == "cooc":
        return cooccurrence_embeddings(train_seqs, items, cfg.embedding_dim, cfg.window, seed)
    if cfg.embeddings == "mf":
        return matrix_factorization_embeddings(train_seqs, items, cfg.embedding_dim, seed)
    if not cfg.embeddings.endswith(".npy") or cfg.embedding_ids is None:
        raise ValueError(
            f"--embeddings {cfg.embeddings!r}: expected cooc, mf, or a .npy file together with "
            f"--embedding-ids FILE (one item id per line, in the .npy's row order)"
        )
    return load_npy_embeddings(cfg.embeddings, cfg.embedding_ids, items)


def write_sid_catalog(path: Path, items: list[str], sids: SemanticIds, log: InteractionLog) -> None:
    """{"sids": {"c1,c2,c3": [item]}, "items": {item: attributes}} sorted by SID."""
    order = np.lexsort(sids.codes.T[::-1])
    entries = {",".join(map(str, sids.codes[r].tolist())): [items[r]] for r in order.tolist()}
    meta = {item: log.metadata[item] for item in items if item in log.metadata}
    path.write_text(_one_entry_per_line({"sids": entries, "items": meta}), "utf-8")


def _one_entry_per_line(doc: dict[str, dict[str, Any]]) -> str:
    """JSON with one SID or item per line: diffable, and still small."""
    parts = []
    for key, entries in doc.items():
        lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items())
        parts.append(f"{json.dumps(key)}: {{\n{lines}\n}}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _write_recipe_json(path: Path, cfg: RecipeConfig, report: BuildReport) -> None:
    import sklearn
    import torch
    import transformers

    doc = {
        "recipe": cfg.model_dump(mode="json"),
        "data": {"users": report.users, "items": report.items, "examples": report.examples},
        "sids": {"level_sizes": list(report.level_sizes), "collision_rule": report.collision_rule,
                 "collided_items": report.collided},
        "train_loss": [round(x, 6) for x in report.losses],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "scikit-learn": sklearn.__version__},
    }  # fmt: skip
    path.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")


def read_recipe(model_dir: str | Path) -> RecipeConfig | None:
    """The RecipeConfig a checkpoint was built with, or None when it has no recipe.json."""
    path = Path(model_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    return RecipeConfig.model_validate(json.loads(path.read_text())["recipe"])
