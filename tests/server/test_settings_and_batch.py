"""Settings layering (flags > FLASHREC_* variables > config file > defaults), bad settings as
one-line errors with exit code 2, and the JSONL batch through the engine loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashrec_core.server.settings import load_settings


def test_flags_override_env_override_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        'port = 9001\nmax_queue = 7\nwarmup_n = [4, 8]\n[engine]\nmodel_path = "/from/file"\n'
        'max_wave_rows = 512\n[search]\nsid_normalization = "sid"\n'
    )
    monkeypatch.setenv("FLASHREC_PORT", "9002")
    monkeypatch.setenv("FLASHREC_ENGINE__MODEL_PATH", "/from/env")
    s = load_settings({"engine": {"device": "cpu"}}, str(config))
    assert s.port == 9002, "env beats the file"
    assert s.engine.model_path == "/from/env" and s.engine.device == "cpu"
    assert s.engine.max_wave_rows == 512 and s.search.sid_normalization == "sid"
    assert s.max_queue == 7 and s.warmup_n == (4, 8)
    monkeypatch.setenv("FLASHREC_ADMISSION_DELAY_FACTOR", "1.5")
    assert load_settings({}, str(config)).admission_delay_factor == 1.5
    monkeypatch.setenv("FLASHREC_GC_YOUNG_THRESHOLD", "50000")
    assert load_settings({}, str(config)).gc_young_threshold == 50_000
    s = load_settings({"port": 9003, "engine": {"model_path": "/from/flag"}}, str(config))
    assert (s.port, s.engine.model_path) == (9003, "/from/flag"), "flags beat everything"


def test_json_config_and_secret_key(tmp_path: Path) -> None:
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"api_key": "s3cr3t-key", "engine": {"model_path": "/m"}}))
    s = load_settings({}, str(config))
    assert s.api_key is not None and s.api_key.get_secret_value() == "s3cr3t-key"
    assert "s3cr3t" not in repr(s), "the key never appears in logs or reprs"
    assert s.model_name == "m"


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrec_core.cli", "serve", *args], capture_output=True,
        text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        (("--model-path", "/nonexistent/dir"), "/nonexistent/dir"),
        (("--model-path", "/tmp", "--port", "70000"), "setting port:"),
        (
            ("--model-path", "/tmp", "--config", "/nonexistent.toml"),
            "config file /nonexistent.toml",
        ),
        (("--model-path", "/tmp", "--warmup-n", "4,x"), "comma-separated integers"),
        (
            ("--model-path", "/tmp", "--admission-delay-factor", "-1"),
            "setting admission_delay_factor:",
        ),  # fmt: skip
        (("--model-path", "/tmp", "--gc-young-threshold", "5"), "setting gc_young_threshold:"),
    ],
)
def test_bad_settings_fail_with_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHREC_")}
    done = _serve(*args, env=env)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flashrec serve: error:") and message in last, done.stderr


def test_batch_file_through_the_loop(checkpoint: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "user history w1 w2"}], "n": 4},
        {"custom_id": "c1", "url": "/v1/completions", "body": {"prompt": "w3 w4", "n": 2}},
        {"prompt": "w5", "n": 0},
        {"custom_id": "no-kind", "body": {"n": 2}},
    ]
    src.write_bytes(
        b"\n".join([*(json.dumps(x).encode() for x in lines), b"{not json", b"\xff\xfe", b""])
    )
    done = subprocess.run(
        [sys.executable, "-m", "flashrec_core.cli", "generate", "--model-path", str(checkpoint),
         "--catalog", str(checkpoint / "catalog.json"), "--device", "cpu",
         "--input", str(src), "--output", str(dst)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 answered, 4 error lines" in done.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["line"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert [r["status_code"] for r in out] == [200, 200, 400, 400, 400, 400]
    assert len(out[0]["response"]["choices"]) == 4 and out[1]["custom_id"] == "c1"
    assert out[1]["response"]["object"] == "text_completion"
    assert out[2]["error"]["param"] == "n"
    assert "not JSON" in out[4]["error"]["message"] and "UTF-8" in out[5]["error"]["message"]
