"""CLI commands `flashrec recipe build`, `flashrec recipe synth` and `flashrec eval`,
registered on the main parser by `add_recipe_commands`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_recipe_commands(sub: Any) -> None:
    """Register `recipe` (build, synth) and `eval` on the `flashrec` subparsers."""
    from flashrec_core.cli import add_engine_args, add_search_args

    recipe = sub.add_parser("recipe", help="build a GenRec checkpoint from an interaction log")
    rsub = recipe.add_subparsers(dest="recipe_command", required=True)
    _add_build(rsub.add_parser("build", help="interaction log -> SIDs -> trained checkpoint"))
    synth = rsub.add_parser("synth", help="write the built-in synthetic log as CSV files")
    synth.add_argument("out", help="directory for interactions.csv and items.csv")
    synth.add_argument("--users", type=int, default=2000, help="users to simulate")
    synth.add_argument("--seed", type=int, default=0, help="seed of the simulation")
    synth.set_defaults(func=cmd_synth)

    ev = sub.add_parser("eval", help="recall/NDCG of a model through the engine vs baselines")
    add_engine_args(ev)
    add_search_args(ev)
    _add_log_args(ev, defaults=False)
    ev.add_argument("--split", choices=["test", "valid"], default="test",
                    help="held-out item scored: each user's last (test) or second-to-last")  # fmt: skip
    ev.add_argument("-n", type=int, default=20, help="beam width (>= 20, the largest cutoff)")
    ev.add_argument("--max-history", type=int, default=None, help="default: recipe.json's")
    ev.add_argument("--max-users", type=int, default=None, help="evaluate the first N users")
    ev.add_argument("--batch", type=int, default=256, help="requests per engine.generate call")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval)


def _add_log_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    """Interaction log flags; with defaults=False unset flags fall back to recipe.json."""

    def d(value: Any) -> Any:
        return value if defaults else None

    p.add_argument("--interactions", default=None, help="interaction log (CSV/TSV/MovieLens)")
    p.add_argument("--format", choices=["auto", "csv", "tsv", "movielens"], default=d("auto"),
                   help="the log's reader (auto: from the file, docs/recipe.md)")  # fmt: skip
    p.add_argument("--user-col", default=d("user_id"), help="user id column")
    p.add_argument("--item-col", default=d("item_id"), help="item id column")
    p.add_argument("--time-col", default=d("timestamp"), help="time column (orders each history)")
    p.add_argument("--rating-col", default=None, help="column compared with --min-rating")
    p.add_argument("--min-rating", type=float, default=None, help="drop rows rated below")
    p.add_argument("--items", default=None, help="item metadata CSV/TSV (item_id,title,...)")


def _add_build(b: argparse.ArgumentParser) -> None:
    from flashrec_core.recipe.config import ModelShape

    _add_log_args(b, defaults=True)
    b.add_argument("--synthetic", action="store_true", help="use the built-in synthetic log")
    b.add_argument("--synthetic-users", type=int, default=2000, help="users of --synthetic")
    b.add_argument("--synthetic-seed", type=int, default=0, help="seed of --synthetic")
    b.add_argument("--out", required=True, help="checkpoint directory to write")
    b.add_argument("--arch", default=None, help="default: the plugin marked recipe_default")
    b.add_argument("--embeddings", default="cooc", help="cooc, mf, or FILE.npy")
    b.add_argument("--embedding-ids", default=None, help="with FILE.npy: item id per row")
    b.add_argument("--embedding-dim", type=int, default=32, help="item vector size (cooc, mf)")
    b.add_argument("--window", type=int, default=5, help="co-occurrence window (cooc)")
    b.add_argument("--levels", type=int, default=3, help="SID levels L")
    b.add_argument("--codebook-size", type=int, default=16, help="codes per level K")
    b.add_argument("--collision", choices=["auto", "reassign", "extra-level"], default="auto",
                   help="items sharing a SID: move them to free codes, or add a level (auto: "
                   "reassign where every prefix has room)")  # fmt: skip
    b.add_argument("--max-history", type=int, default=20, help="items per prompt")
    shape = ModelShape()
    for flag, default in (("hidden-size", shape.hidden_size), ("layers", shape.num_layers),
                          ("heads", shape.num_heads), ("kv-heads", shape.num_kv_heads),
                          ("head-dim", shape.head_dim),
                          ("intermediate-size", shape.intermediate_size)):  # fmt: skip
        b.add_argument(f"--{flag}", type=int, default=default, help="model shape")
    b.add_argument("--epochs", type=int, default=8, help="training passes over the examples")
    b.add_argument("--batch-size", type=int, default=128, help="examples a training step")
    b.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    b.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    b.add_argument("--warmup-steps", type=int, default=100, help="linear learning-rate warm-up")
    b.add_argument("--seed", type=int, default=0, help="seed of k-means, weights and batches")
    b.add_argument("--threads", type=int, default=1, help="torch threads (bit-exact per count)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("-v", "--verbose", action="store_true", help="log each stage")
    b.set_defaults(func=cmd_build)


def _source(args: argparse.Namespace) -> Any:
    from flashrec_core.recipe import LogFormat, SyntheticSource

    if getattr(args, "synthetic", False):
        if args.interactions is not None:
            raise ValueError("give either --interactions FILE or --synthetic, not both")
        return SyntheticSource(users=args.synthetic_users, seed=args.synthetic_seed)
    if args.interactions is None:
        raise ValueError("pass --interactions FILE (or --synthetic for the built-in log)")
    fields = {k: getattr(args, k) for k in ("format", "user_col", "item_col", "time_col",
                                            "rating_col", "min_rating")}  # fmt: skip
    items = str(Path(args.items).resolve()) if args.items else None
    return LogFormat(
        path=str(Path(args.interactions).resolve()), items_path=items,
        **{k: v for k, v in fields.items() if v is not None},
    )  # fmt: skip


def cmd_build(args: argparse.Namespace) -> int:
    from flashrec_core.recipe import ModelShape, RecipeConfig, TrainConfig, build_recipe

    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not (out / "recipe.json").is_file():
        raise ValueError(f"--out {out} is a non-empty directory not written by the recipe")
    cfg = RecipeConfig(
        source=_source(args), arch=args.arch, embeddings=args.embeddings, embedding_ids=args.embedding_ids,
        embedding_dim=args.embedding_dim, window=args.window, levels=args.levels,
        codebook_size=args.codebook_size, collision=args.collision, max_history=args.max_history,
        model=ModelShape(hidden_size=args.hidden_size, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                         intermediate_size=args.intermediate_size),
        train=TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                          weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
                          seed=args.seed, threads=args.threads),
    )  # fmt: skip
    r = build_recipe(cfg, out, progress=not args.no_progress)
    print(
        f"wrote {r.out}: {r.items} items, {r.users} users, {r.examples} training examples, SID "
        f"levels {','.join(map(str, r.level_sizes))} ({r.collided} collisions, rule "
        f"{r.collision_rule}), final loss {r.losses[-1]:.4f}"
    )
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from flashrec_core.recipe.synthetic import SyntheticConfig, write_synthetic

    paths = write_synthetic(Path(args.out), SyntheticConfig(users=args.users, seed=args.seed))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flashrec_core.cli import engine_config_from_args, search_config_from_args
    from flashrec_core.embedded import with_default_model
    from flashrec_core.engine.engine import Engine
    from flashrec_core.evaluation import run_eval
    from flashrec_core.recipe import leave_last_out, load_source, read_recipe
    from flashrec_core.recipe.source import describe

    args = with_default_model(args)
    model_dir = Path(args.model_path)
    if args.catalog is None and (model_dir / "catalog.json").is_file():
        args.catalog = str(model_dir / "catalog.json")
    recipe = read_recipe(model_dir)
    source = _eval_source(args, recipe)
    max_history = args.max_history or (recipe.max_history if recipe else 20)
    split = leave_last_out(load_source(source).sequences)
    engine = Engine.from_config(engine_config_from_args(args), search_config_from_args(args))
    report = run_eval(
        engine, split, args.split, source=describe(source), max_history=max_history, n=args.n,
        batch=args.batch, progress=not args.no_progress, max_cases=args.max_users,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    doc = report.as_dict()
    print(f"{doc['source']}: {args.split} split, {doc['cases']} users, {doc['catalog_items']} "
          f"catalog items, beam width {args.n}")  # fmt: skip
    print(report.table())
    return 0


def _eval_source(args: argparse.Namespace, recipe: Any) -> Any:
    """--interactions with its flags, else the source recorded in the model's recipe.json."""
    if args.interactions is not None:
        return _source(args)
    if recipe is None:
        raise ValueError(
            f"{args.model_path} has no recipe.json, so the held-out data is unknown; pass "
            f"--interactions FILE (and its format flags)"
        )
    print(f"flashrec eval: data from {args.model_path}/recipe.json", file=sys.stderr)
    return recipe.source
