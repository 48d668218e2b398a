"""Every bad input a user can cause ends in one line naming the file, key or value and the fix,
with exit code 2 (issue 10). One test per input, through the `flashrec` command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flashrec_core.cli import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-inputs") / "model"
    assert main(["demo", str(path), "--items", "200", "--level-sizes", "16,16,16"]) == 0
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def _generate(capsys, model: Path, *extra: str) -> tuple[int, str]:
    return _run(capsys, "generate", "--model-path", str(model), "--device", "cpu", *extra)


def _assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("flashrec "), f"not one line: {err!r}"
    for needle in needles:
        assert needle in err, f"{needle!r} missing from {err!r}"


def _copy(demo: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(demo, dst)
    return dst


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("flashrec-core ")


def test_truncated_safetensors_names_the_file(demo: Path, tmp_path: Path, capsys) -> None:
    model = _copy(demo, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, err = _generate(capsys, model, "--prompt", "w1")
    _assert_one_line(code, err, str(weights), "truncated or corrupt")


def test_corrupt_safetensors_header_names_the_file(demo: Path, tmp_path: Path, capsys) -> None:
    model = _copy(demo, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 64)
    code, err = _generate(capsys, model, "--prompt", "w1")
    _assert_one_line(code, err, str(weights), "truncated or corrupt")


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"hidden_size": "64"}, ["'hidden_size'", "'64'"]),
        (
            {"num_attention_heads": 3, "num_key_value_heads": 2},
            ["num_attention_heads=3", "num_key_value_heads=2"],
        ),
    ],
    ids=["string-size", "heads-not-multiple-of-kv-heads"],
)
def test_bad_config_field_is_named_before_transformers_reads_it(
    demo: Path, tmp_path: Path, capsys, fields: dict, needles: list[str]
) -> None:
    model = _copy(demo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    code, err = _generate(capsys, model, "--prompt", "w1")
    _assert_one_line(code, err, str(model / "config.json"), *needles)


def test_flashinfer_backend_on_cpu(demo: Path, capsys) -> None:
    code, err = _generate(capsys, demo, "--prompt", "w1", "--attention-backend", "flashinfer")
    _assert_one_line(code, err, "--attention-backend flashinfer", "--attention-backend torch")


def test_catalog_with_invalid_utf8(demo: Path, tmp_path: Path, capsys) -> None:
    catalog = tmp_path / "c.csv"
    catalog.write_bytes(b"item-\xff,1,2,3\n")
    code, err = _generate(capsys, demo, "--prompt", "w1", "--catalog", str(catalog))
    _assert_one_line(code, err, str(catalog), "not valid UTF-8", "byte 5")


def test_messages_file_with_invalid_utf8(demo: Path, tmp_path: Path, capsys) -> None:
    messages = tmp_path / "m.json"
    messages.write_bytes(b'[{"role": "user", "content": "w1 \xc3"}]')
    code, err = _generate(capsys, demo, "--messages-json", str(messages))
    _assert_one_line(code, err, str(messages), "not valid UTF-8")


def test_demo_onto_an_existing_file(tmp_path: Path, capsys) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    code, err = _run(capsys, "demo", str(target))
    _assert_one_line(code, err, str(target), "existing file")
    assert target.read_text() == "keep me"


def test_demo_into_a_directory_in_use(demo: Path, capsys) -> None:
    code, err = _run(capsys, "demo", str(demo))
    _assert_one_line(code, err, str(demo), "not empty")


@pytest.mark.parametrize(
    ("flag", "needle"),
    [("--length-penalty", "--length-penalty nan"), ("--temperature", "temperature")],
)
def test_nan_search_settings(demo: Path, capsys, flag: str, needle: str) -> None:
    code, err = _generate(capsys, demo, "--prompt", "w1", "--catalog",
                          str(demo / "catalog.json"), flag, "nan")  # fmt: skip
    _assert_one_line(code, err, needle, "finite")


@pytest.mark.parametrize("prompt", ["", "   \t "])
def test_empty_or_whitespace_prompt(demo: Path, capsys, prompt: str) -> None:
    code, err = _generate(capsys, demo, "--prompt", prompt)
    _assert_one_line(code, err, "prompt is empty")


def test_one_row_csv_missing_a_code(demo: Path, tmp_path: Path, capsys) -> None:
    catalog = tmp_path / "one.csv"
    catalog.write_text("item-1,3,4\n")
    code, err = _generate(capsys, demo, "--prompt", "w1", "--catalog", str(catalog))
    _assert_one_line(code, err, str(catalog), "depth 2", "--sid-depth 2")


def test_semicolon_separated_csv(demo: Path, tmp_path: Path, capsys) -> None:
    catalog = tmp_path / "semi.csv"
    catalog.write_text("item_id;c1;c2;c3\nitem-1;1;2;3\n")
    code, err = _generate(capsys, demo, "--prompt", "w1", "--catalog", str(catalog))
    _assert_one_line(code, err, str(catalog), "line 1 has 1 field", "','")


def test_unknown_disable_fused_switch_lists_the_valid_ones(demo: Path, capsys) -> None:
    code, err = _generate(capsys, demo, "--prompt", "w1", "--disable-fused", "enable_fused_rms")
    _assert_one_line(code, err, "--disable-fused enable_fused_rms", "enable_fused_rms_fp8")


def test_unknown_fused_requirement_lists_the_valid_ones() -> None:
    from flashrec_core.spec import FusedPath

    with pytest.raises(ValueError, match=r"unknown requirement\(s\) \['trition'\]; valid: triton"):
        FusedPath("x", "enable_fused_x", "m:f", "a path", requires=("trition",))
