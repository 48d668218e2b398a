from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from flashrec_core.search import (
    CatalogError,
    build_catalog,
    convert_packed_catalog,
    load_catalog,
)

SIZES = (8, 4, 6)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def write_json(path: Path, obj: object) -> Path:
    return write(path, json.dumps(obj))


def test_json_catalog_sorted_with_shared_sids(tmp_path) -> None:
    path = write_json(tmp_path / "c.json", {"7,3,5": "x", "0,1,2": 42, "0,0,5": ["y", 7]})
    cat = load_catalog(path, SIZES)
    assert cat.codes.dtype == np.int64
    assert cat.codes.tolist() == [[0, 0, 5], [0, 1, 2], [7, 3, 5]]
    assert cat.items == (("y", "7"), ("42",), ("x",))
    assert (len(cat), cat.num_items, cat.depth, cat.level_sizes) == (3, 4, 3, SIZES)
    assert cat.lookup((0, 1, 2)) == ("42",)
    assert cat.row_of([7, 3, 5]) == 2
    assert cat.row_of([7, 3, 4]) == -1
    assert cat.row_of([7, 3]) == -1
    with pytest.raises(KeyError, match=r"SID \(1, 1, 1\) is not in the catalog"):
        cat.lookup((1, 1, 1))


def test_csv_with_header_collects_items_of_a_sid(tmp_path) -> None:
    text = "item_id,c1,c2,c3\nb,1,2,3\na,0,0,0\n\nc,1,2,3\n"
    cat = load_catalog(write(tmp_path / "c.csv", text), SIZES)
    assert cat.codes.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert cat.items == (("a",), ("b", "c"))  # file order within a SID
    assert cat.num_items == 3


def test_csv_without_header_and_tsv(tmp_path) -> None:
    cat = load_catalog(write(tmp_path / "c.csv", "a,0,0,1\r\nb,0,0,0\r\n"), SIZES)
    assert cat.items == (("b",), ("a",))
    tsv = load_catalog(write(tmp_path / "c.tsv", "item\tx\ty\tz\nq,1\t2\t3\t4\n"), SIZES)
    assert tsv.items == (("q,1",),) and tsv.codes.tolist() == [[2, 3, 4]]


def test_csv_quoted_item_ids(tmp_path) -> None:
    cat = load_catalog(write(tmp_path / "c.csv", '"shoe, red",1,1,1\nplain,0,1,1\n'), SIZES)
    assert cat.items == (("plain",), ("shoe, red",))


def test_shallower_catalog_keeps_its_depth(tmp_path) -> None:
    cat = load_catalog(write(tmp_path / "c.csv", "a,3,2\n"), SIZES)
    assert (cat.depth, cat.level_sizes) == (2, (8, 4))


def test_code_out_of_range_names_file_key_and_value(tmp_path) -> None:
    path = write_json(tmp_path / "c.json", {"0,0,0": "a", "1,4,0": "b"})
    with pytest.raises(CatalogError) as err:
        load_catalog(path, SIZES)
    msg = str(err.value)
    assert str(path) in msg and "key '1,4,0' has code 4 at level 1, expected 0..3" in msg
    csv_path = write(tmp_path / "c.csv", "a,0,0,0\nb,0,0,-1\n")
    with pytest.raises(CatalogError, match=r"c\.csv: line 2 has code -1 at level 2, expected 0..5"):
        load_catalog(csv_path, SIZES)


def test_ragged_depths(tmp_path) -> None:
    path = write_json(tmp_path / "c.json", {"0,0,0": "a", "0,1": "b"})
    with pytest.raises(CatalogError, match=r"key '0,1' has 2 codes but key '0,0,0' has 3"):
        load_catalog(path, SIZES)
    csv_path = write(tmp_path / "c.csv", "a,0,0,0\nb,0,1\n")
    with pytest.raises(CatalogError, match=r"line 2 has 3 fields \['b', '0', '1'\], expected 4"):
        load_catalog(csv_path, SIZES)


def test_duplicate_json_keys_are_detected(tmp_path) -> None:
    path = write(tmp_path / "c.json", '{"0,0,0": "a", "1,1,1": "b", "0,0,0": "c"}')
    with pytest.raises(CatalogError, match=r"c\.json: key '0,0,0' appears twice"):
        load_catalog(path, SIZES)
    path = write_json(tmp_path / "d.json", {"1,2,3": "a", "01,2,3": "b"})
    with pytest.raises(CatalogError, match=r"key '1,2,3' and key '01,2,3' name SID \(1, 2, 3\)"):
        load_catalog(path, SIZES)


@pytest.mark.parametrize(
    "text",
    [
        # whitespace before a colon: a count of quote-colon pairs alone would see one key, as
        # many as orjson keeps, and miss the repeat
        '{"0,0,0"\n :"a", "0,0,0":"b"}',
        '{"sids": {"0,0,0": "a\\": x", "0,0,0": "b"}}',  # a quote and a colon in a value
        '{"sids": {"0,0,0": "a", "1,1,1": "b", "0,0,0": "c"}, "items": {"a": {"k": NaN}}}',
    ],
)
def test_repeated_keys_are_detected_whatever_parses_them(tmp_path, text: str) -> None:
    """The loader parses with orjson where its result can be trusted (it drops a repeated key
    silently) and with the standard library otherwise: every way in reports the repeat."""
    path = write(tmp_path / "c.json", text)
    with pytest.raises(CatalogError, match=r"key '0,0,0' appears twice"):
        load_catalog(path, SIZES)


def test_both_parsers_read_a_catalog_alike(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalog without repeats, with metadata, nested values, escapes and odd spacing, loads
    through orjson (the count holds) as through the standard library."""
    import json

    from flashrec_core.search import catalog_formats as formats

    body = {"sids": {"0,0,0": "a", "1,2,3": ["b", 7], "2,0,1": "c"},
            "items": {"a": {"tags": ["x", {"y": 1.5}], "n": 3}, "b": {"t": "é", "p": "C:\\d"}}}  # fmt: skip
    text = json.dumps(body, indent=1, separators=(" ,", " : "))  # \u00e9, \\: escapes
    path = write(tmp_path / "c.json", text)
    assert formats._count_keys(formats.orjson.loads(text)) == len(formats._KEY_END.findall(text))
    assert formats._parse_json(text) == body
    fast = load_catalog(path, SIZES)
    monkeypatch.setattr(
        formats, "_parse_json", lambda t: json.loads(t, object_pairs_hook=formats._object)
    )
    slow = load_catalog(path, SIZES)
    assert fast.items == slow.items and (fast.codes == slow.codes).all()
    assert fast.metadata == slow.metadata == body["items"]


def test_duplicate_item_in_one_sid(tmp_path) -> None:
    path = write(tmp_path / "c.csv", "a,1,1,1\nb,0,0,0\na,1,1,1\n")
    with pytest.raises(CatalogError, match=r"SID \(1, 1, 1\) lists an item id twice \('a', 'a'\)"):
        load_catalog(path, SIZES)


def test_empty_catalogs(tmp_path) -> None:
    with pytest.raises(CatalogError, match=r"e\.json must be a non-empty JSON object"):
        load_catalog(write(tmp_path / "e.json", "{}"), SIZES)
    with pytest.raises(CatalogError, match=r"e\.csv is empty"):
        load_catalog(write(tmp_path / "e.csv", "item_id,c1,c2,c3\n\n"), SIZES)
    with pytest.raises(CatalogError, match="is empty"):
        build_catalog(np.zeros((0, 3), dtype=np.int64), [], SIZES)


def test_non_integer_codes(tmp_path) -> None:
    path = write_json(tmp_path / "c.json", {"0,0,0": "a", "0,x,1": "b"})
    with pytest.raises(CatalogError, match=r"key '0,x,1' has code 'x' at level 1"):
        load_catalog(path, SIZES)
    path = write(tmp_path / "c.csv", "a,0,0,0\nb,0,1,2.5\n")
    with pytest.raises(CatalogError, match=r"line 2 has code '2.5' at level 2"):
        load_catalog(path, SIZES)


def test_catalog_deeper_than_level_sizes(tmp_path) -> None:
    path = write_json(tmp_path / "c.json", {"0,0,0,0": "a"})
    with pytest.raises(CatalogError, match=r"depth 4 \(key '0,0,0,0'\).*cover only 3 levels"):
        load_catalog(path, SIZES)


@pytest.mark.parametrize("value", [1.5, True, [], {"a": 1}, None, ["a", [1]], ["a", "a"]])
def test_bad_item_values(tmp_path, value) -> None:
    path = write_json(tmp_path / "c.json", {"0,0,0": value})
    with pytest.raises(CatalogError, match=r"key '0,0,0' has value .*expected an item id"):
        load_catalog(path, SIZES)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(CatalogError, match=r"missing\.json does not exist"):
        load_catalog(tmp_path / "missing.json", SIZES)
    with pytest.raises(CatalogError, match=r"extension '\.txt'; expected \.json/\.csv/\.tsv"):
        load_catalog(write(tmp_path / "c.txt", "a,0,0,0"), SIZES)
    with pytest.raises(CatalogError, match=r"bad\.json is not valid JSON"):
        load_catalog(write(tmp_path / "bad.json", '{"0,0,0": '), SIZES)
    with pytest.raises(CatalogError, match=r"must be a non-empty JSON object"):
        load_catalog(write_json(tmp_path / "list.json", [["0,0,0", "a"]]), SIZES)


def test_packed_keys_are_rejected_with_convert_hint(tmp_path) -> None:
    path = write_json(tmp_path / "p.json", {"5": "a", "77": "b"})
    with pytest.raises(CatalogError) as err:
        load_catalog(path, SIZES)
    assert f"flashrec catalog convert {path} OUT.json --level-sizes 8,4,6" in str(err.value)


def test_single_level_catalog_keys_have_no_commas(tmp_path) -> None:
    cat = load_catalog(write_json(tmp_path / "c.json", {"5": "a", "2": "b"}), (8,))
    assert cat.codes.tolist() == [[2], [5]] and cat.items == (("b",), ("a",))


def test_convert_packed_catalog_mixed_radix(tmp_path) -> None:
    sids = {(7, 3, 5): "x", (0, 1, 2): ["y", 9], (0, 0, 0): 4}
    packed = {str(a * 4 * 6 + b * 6 + c): item for (a, b, c), item in sids.items()}
    src = write_json(tmp_path / "p.json", packed)
    dst = tmp_path / "out.json"
    cat = convert_packed_catalog(src, dst, SIZES)
    assert json.loads(dst.read_text()) == {"7,3,5": "x", "0,1,2": ["y", 9], "0,0,0": 4}
    assert cat.codes.tolist() == [[0, 0, 0], [0, 1, 2], [7, 3, 5]]
    assert cat.items == (("4",), ("y", "9"), ("x",))
    reloaded = load_catalog(dst, SIZES)
    assert reloaded.items == cat.items and np.array_equal(reloaded.codes, cat.codes)


def test_convert_rejects_bad_packed_keys(tmp_path) -> None:
    out = tmp_path / "out.json"
    too_big = write_json(tmp_path / "p.json", {str(8 * 4 * 6): "a"})
    with pytest.raises(
        CatalogError, match=r"packed key '192' has code 8 at level 0, expected 0..7"
    ):
        convert_packed_catalog(too_big, out, SIZES)
    not_int = write_json(tmp_path / "q.json", {"1,2,3": "a"})
    with pytest.raises(CatalogError, match=r"packed key '1,2,3' has code '1,2,3'"):
        convert_packed_catalog(not_int, out, SIZES)
    assert not out.exists()


@pytest.mark.slow
def test_million_item_csv_loads_in_seconds(tmp_path) -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8192, size=(1_000_000, 3))
    table = np.concatenate([np.arange(len(codes))[:, None], codes], axis=1)  # item id = row
    fields = map(str, table.ravel().tolist())
    rows = "\n".join(map(",".join, zip(*[fields] * 4, strict=True)))
    path = write(tmp_path / "big.csv", "item_id,c1,c2,c3\n" + rows)
    start = time.perf_counter()
    cat = load_catalog(path, (8192, 8192, 8192))
    elapsed = time.perf_counter() - start
    assert cat.num_items == 1_000_000
    assert len(cat) == len(np.unique((codes[:, 0] * 8192 + codes[:, 1]) * 8192 + codes[:, 2]))
    assert "123456" in cat.lookup(tuple(codes[123_456]))
    assert elapsed < 20, f"loading 1M rows took {elapsed:.1f} s"
    print(f"1M-row CSV catalog loaded in {elapsed:.2f} s")
