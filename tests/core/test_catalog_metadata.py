"""The JSON catalog form with item metadata: {"sids": {...}, "items": {item: {attr: value}}}."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrec_core.search import CatalogError, load_catalog

SIZES = (8, 4, 6)


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def test_sids_and_items_load_into_metadata(tmp_path: Path) -> None:
    obj = {
        "sids": {"1,2,3": ["b", "c"], "0,0,1": "a"},
        "items": {"a": {"title": "Pad Thai", "category": "Thai > Lunch"}, "c": {"tags": [1, 2]}},
    }
    cat = load_catalog(_write(tmp_path / "c.json", obj), SIZES)
    assert cat.codes.tolist() == [[0, 0, 1], [1, 2, 3]]
    assert cat.items == (("a",), ("b", "c"))
    assert cat.metadata == {
        "a": {"title": "Pad Thai", "category": "Thai > Lunch"},
        "c": {"tags": [1, 2]},
    }


def test_bare_catalog_has_empty_metadata(tmp_path: Path) -> None:
    cat = load_catalog(_write(tmp_path / "c.json", {"1,2,3": "x"}), SIZES)
    assert cat.metadata == {}
    only_sids = load_catalog(_write(tmp_path / "d.json", {"sids": {"1,2,3": "x"}}), SIZES)
    assert only_sids.items == (("x",),) and only_sids.metadata == {}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"sids": {"1,2,3": "x"}, "items": {"y": {"title": "t"}}}, "metadata for 'y'"),
        ({"sids": {"1,2,3": "x"}, "items": {"x": "Pad Thai"}}, "expected an object of attributes"),
        ({"sids": {"1,2,3": "x"}, "extra": {}}, "unexpected keys ['extra']"),
        ({"sids": {}}, 'non-empty "sids" object'),
        ({"sids": {"1,2,9": "x"}}, "code 9 at level 2"),
    ],
    ids=["unknown-item", "non-object", "extra-key", "empty-sids", "bad-code"],
)
def test_metadata_errors_name_the_problem(tmp_path: Path, obj: dict, message: str) -> None:
    path = _write(tmp_path / "bad.json", obj)
    with pytest.raises(CatalogError, match=None) as err:
        load_catalog(path, SIZES)
    assert message in str(err.value) and str(path) in str(err.value)
