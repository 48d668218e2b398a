"""`flashrec recipe build` end to end on small logs (a MovieLens-style file, a CSV with named
columns and item metadata), its determinism, and the stages one by one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashrec_core.cli import main
from flashrec_core.recipe import (
    InteractionsError,
    LogFormat,
    SyntheticConfig,
    leave_last_out,
    load_log,
    synthetic_log,
)
from flashrec_core.recipe.rqkmeans import QuantizationError, quantize
from flashrec_core.recipe.tokenizer import build_recipe_tokenizer
from flashrec_core.search import load_catalog

TINY = ["--epochs", "1", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads",
        "1", "--intermediate-size", "64", "--codebook-size", "8", "--embedding-dim", "16",
        "--no-progress"]  # fmt: skip
CHECKPOINT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "catalog.json", "recipe.json"}  # fmt: skip


def _movielens_file(path: Path, users: int = 120) -> Path:
    """A headerless `user item rating timestamp` TSV (MovieLens 100k layout), rows shuffled so
    that the recipe must sort each user's rows by time."""
    log, stamps = synthetic_log(SyntheticConfig(users=users, seed=3))
    items = {item: n for n, item in enumerate(sorted(log.items), 1)}
    rows = [(int(u[1:]) + 1, items[i]) for u, seq in log.sequences.items() for i in seq]
    lines = [f"{u}\t{i}\t{1 + (u * i) % 5}\t{t}" for (u, i), t in zip(rows, stamps.tolist())]
    order = np.random.default_rng(0).permutation(len(lines))
    path.write_text("\n".join(lines[j] for j in order) + "\n")
    return path


@pytest.fixture(scope="module")
def movielens_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ml")
    data = _movielens_file(tmp / "u.data")
    out = tmp / "model"
    assert main(["recipe", "build", "--interactions", str(data), "--out", str(out), *TINY]) == 0
    return out


def test_movielens_build_writes_a_loadable_checkpoint(movielens_model: Path, capsys) -> None:
    assert CHECKPOINT_FILES <= {p.name for p in movielens_model.iterdir()}
    config = json.loads((movielens_model / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is True
    recipe = json.loads((movielens_model / "recipe.json").read_text())
    assert recipe["recipe"]["source"]["kind"] == "file"
    catalog = load_catalog(movielens_model / "catalog.json", recipe["sids"]["level_sizes"])
    assert catalog.num_items == recipe["data"]["items"] == len(catalog), "one item per SID"
    code = main(["generate", "--model-path", str(movielens_model), "--catalog",
                 str(movielens_model / "catalog.json"), "--prompt", "1 2 3", "-n", "5", "--json",
                 "--device", "cpu"])  # fmt: skip
    assert code == 0
    choices = json.loads(capsys.readouterr().out)["choices"]
    assert len(choices) == 5 and all(len(c["items"]) == 1 for c in choices)


def test_eval_reads_the_split_back_from_recipe_json(movielens_model: Path, capsys) -> None:
    code = main(["eval", "--model-path", str(movielens_model), "--json", "--no-progress",
                 "--device", "cpu"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "test" and report["cases"] == 120
    assert set(report["systems"]) == {"flashrec", "popularity", "cooccurrence"}
    assert report["systems"]["flashrec"]["invalid_sid_rate"] == 0.0


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    data = _movielens_file(tmp_path / "u.data", users=60)

    def build(name: str, seed: str) -> Path:
        out = tmp_path / name
        args = ["recipe", "build", "--interactions", str(data), "--out", str(out), "--seed", seed]
        assert main([*args, *TINY]) == 0
        return out

    first, second, other = build("a", "0"), build("b", "0"), build("c", "1")
    for name in sorted(p.name for p in first.iterdir()):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    weights = "model.safetensors"
    assert (first / weights).read_bytes() != (other / weights).read_bytes()


def test_csv_with_named_columns_and_item_metadata(tmp_path: Path, capsys) -> None:
    log, stamps = synthetic_log(SyntheticConfig(users=80, seed=5))
    rows = [(u, i) for u, seq in log.sequences.items() for i in seq]
    text = "when,who,what\n" + "".join(
        f"{t},{u},{i}\n" for (u, i), t in zip(rows, stamps.tolist(), strict=True)
    )
    (tmp_path / "log.csv").write_text(text)
    meta = "item_id,title,category\n" + "".join(
        f'{i},"{m["title"]}",{m["category"]}\n' for i, m in log.metadata.items()
    )
    (tmp_path / "items.csv").write_text(meta)
    out = tmp_path / "model"
    args = ["recipe", "build", "--interactions", str(tmp_path / "log.csv"), "--user-col", "who",
            "--item-col", "what", "--time-col", "when", "--items", str(tmp_path / "items.csv"),
            "--out", str(out), "--collision", "extra-level", *TINY]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((out / "catalog.json").read_text())
    first, second = log.sequences["u0000"][:2]
    assert doc["items"][first] == log.metadata[first] and " > " in doc["items"][first]["category"]
    assert all(len(key.split(",")) == 4 for key in doc["sids"]), "extra level always added"
    code = main(["generate", "--model-path", str(out), "--catalog", str(out / "catalog.json"),
                 "--prompt", f"{first} {second}", "-n", "3", "--device", "cpu"])  # fmt: skip
    assert code == 0 and capsys.readouterr().out.count("; ") == 3, "titles and categories shown"


def test_leave_last_out() -> None:
    split = leave_last_out({"a": ["1", "2", "3", "4"], "b": ["5", "6"]})
    assert split.train == {"a": ["1", "2"], "b": ["5", "6"]}
    assert [(c.user, c.history, c.target) for c in split.valid] == [("a", ("1", "2"), "3")]
    assert [(c.user, c.history, c.target) for c in split.test] == [("a", ("1", "2", "3"), "4")]


def test_movielens_double_colon_rows_sorted_by_time_and_rating_filter(tmp_path: Path) -> None:
    path = tmp_path / "ratings.dat"
    path.write_text("1::10::5::300\n1::11::2::100\n1::12::4::200\n2::10::5::100\n")
    log = load_log(LogFormat(path=str(path)))
    assert log.sequences == {"1": ["11", "12", "10"], "2": ["10"]}
    kept = load_log(LogFormat(path=str(path), min_rating=4))
    assert kept.sequences == {"1": ["12", "10"], "2": ["10"]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("user_id,item,timestamp\n1,2,3\n", "lacks column(s) ['item_id']"),
        ("user_id,item_id,timestamp\n1,2,yesterday\n", "line 2 has timestamp 'yesterday'"),
        ("1\t2\t3\t4\n1\t2\t3\n", "line 2 has 3 fields"),
    ],
    ids=["missing-column", "bad-timestamp", "ragged-movielens"],
)
def test_log_errors_name_line_and_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "log.csv"
    path.write_text(text)
    with pytest.raises(InteractionsError) as err:
        load_log(LogFormat(path=str(path)))
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # duplicate points
def test_rq_kmeans_gives_unique_sids_under_both_rules() -> None:
    rng = np.random.default_rng(0)
    vectors = np.repeat(rng.normal(size=(20, 8)), 3, axis=0)  # every vector three times
    for rule, depth in (("reassign", 3), ("extra-level", 4)):
        sids = quantize(vectors, levels=3, k=6, seed=0, rule=rule)
        assert sids.codes.shape == (60, depth) and sids.rule == rule and sids.collided >= 40
        assert len({tuple(r) for r in sids.codes.tolist()}) == 60
        assert (sids.codes < np.array(sids.level_sizes)).all()
    with pytest.raises(QuantizationError, match="--collision extra-level"):
        quantize(np.repeat(vectors[:1], 10, axis=0), levels=1, k=4, seed=0, rule="reassign")
    assert quantize(np.repeat(vectors[:8], 10, axis=0), 1, 4, 0, "auto").rule == "extra-level"


def test_tokenizer_keeps_each_item_and_sid_token_whole() -> None:
    tok = build_recipe_tokenizer(["42", "pad-thai", "x.y"], (4, 4))
    ids = tok("42 pad-thai x.y <s_a_3><s_b_0>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["42", "pad-thai", "x.y", "<s_a_3>", "<s_b_0>"]
    with pytest.raises(ValueError, match="collide"):
        build_recipe_tokenizer(["<s_a_0>"], (4,))
