"""A deterministic synthetic food-ordering log with structure a sequence model can learn.

Each user has a long-term taste (three favourite cuisines, Dirichlet weights, a little
exploration) and a sequential habit (meals follow the day: breakfast -> lunch -> dinner ->
dessert -> breakfast, with a chance of skipping around). The next order's meal is predicted by
the last order alone, its cuisine only by the whole history: the last item reveals one favourite
cuisine, the history all three. So a model of the whole history should beat item-to-item
co-occurrence, which sees the last item only.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashrec_core.recipe.interactions import InteractionLog
from flashrec_core.recipe.menu import MEALS, MENU


@dataclass(frozen=True)
class SyntheticConfig:
    users: int = 2000
    seed: int = 0
    min_length: int = 8
    max_length: int = 40
    favourites: int = 3
    explore: float = 0.08
    """Chance that an order picks a cuisine uniformly instead of from the user's favourites."""
    habit: float = 0.85
    """Chance that the next meal follows the day's order; otherwise any meal."""


@dataclass(frozen=True)
class Dish:
    item_id: str
    title: str
    region: str
    cuisine: str
    meal: int


def menu_items() -> list[Dish]:
    """Every dish of the menu, grouped by cuisine then meal; ids are slugs of the titles."""
    dishes = []
    for region, cuisines in MENU.items():
        for cuisine, meals in cuisines.items():
            for meal, titles in enumerate(meals):
                dishes += [Dish(_slug(t), t, region, cuisine, meal) for t in titles]
    ids = [d.item_id for d in dishes]
    assert len(set(ids)) == len(ids), "menu titles must have distinct slugs"
    return dishes


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def synthetic_log(cfg: SyntheticConfig = SyntheticConfig()) -> tuple[InteractionLog, np.ndarray]:
    """(the log with item metadata, unix timestamps per interaction in log order)."""
    dishes = menu_items()
    rng = np.random.default_rng(cfg.seed)
    cuisines = sorted({d.cuisine for d in dishes}, key=[d.cuisine for d in dishes].index)
    cell = {(d.cuisine, d.meal): [] for d in dishes}
    for d in dishes:
        cell[(d.cuisine, d.meal)].append(d.item_id)
    # within a cell, dish popularity is Zipf-like in a per-cell random order
    pop = {key: rng.permutation(np.array([0.4, 0.3, 0.2, 0.1])) for key in cell}
    sequences, stamps = {}, []
    for u in range(cfg.users):
        seq, times = _user(rng, cfg, cuisines, cell, pop)
        sequences[f"u{u:04d}"] = seq
        stamps.append(times)
    meta = {
        d.item_id: {"title": d.title, "category": f"{d.region} > {d.cuisine} > {MEALS[d.meal]}"}
        for d in dishes
    }
    return InteractionLog(sequences=sequences, metadata=meta), np.concatenate(stamps)


def _user(rng, cfg, cuisines, cell, pop) -> tuple[list[str], np.ndarray]:
    favs = rng.choice(len(cuisines), size=cfg.favourites, replace=False)
    weights = rng.dirichlet(np.ones(cfg.favourites))
    length = int(rng.integers(cfg.min_length, cfg.max_length + 1))
    meal = int(rng.integers(len(MEALS)))
    seq = []
    for _ in range(length):
        if rng.random() < cfg.explore:
            cuisine = cuisines[int(rng.integers(len(cuisines)))]
        else:
            cuisine = cuisines[int(favs[rng.choice(cfg.favourites, p=weights)])]
        key = (cuisine, meal)
        seq.append(cell[key][int(rng.choice(len(cell[key]), p=pop[key]))])
        meal = (meal + 1) % len(MEALS) if rng.random() < cfg.habit else int(rng.integers(4))
    start = 1_700_000_000 + int(rng.integers(0, 86_400 * 30))
    times = start + np.cumsum(rng.integers(3 * 3600, 9 * 3600, size=length))
    return seq, times


def write_synthetic(out: Path, cfg: SyntheticConfig = SyntheticConfig()) -> list[Path]:
    """interactions.csv (user_id,item_id,timestamp) and items.csv (item_id,title,category)."""
    log, stamps = synthetic_log(cfg)
    out.mkdir(parents=True, exist_ok=True)
    rows = ((u, i) for u, seq in log.sequences.items() for i in seq)
    lines = [f"{u},{i},{t}" for (u, i), t in zip(rows, stamps.tolist(), strict=True)]
    inter = out / "interactions.csv"
    inter.write_text("user_id,item_id,timestamp\n" + "\n".join(lines) + "\n", "utf-8")
    items = out / "items.csv"
    with items.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["item_id", "title", "category"])
        writer.writerows([i, m["title"], m["category"]] for i, m in log.metadata.items())
    return [inter, items]
