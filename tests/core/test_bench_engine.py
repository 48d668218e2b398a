"""`flashrec bench --write-checkpoint` then `--engine` on CPU: the path users run, end to end
through the CLI (a real checkpoint directory, `Engine.generate`), with strict JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LEVELS = "32,32,32"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "flashrec_core.cli", "bench", "--preset", "qwen3-small", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_bench_engine_on_a_written_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "bench-ckpt"
    wrote = _bench("--write-checkpoint", str(ckpt), "--level-sizes", LEVELS,
                   "--catalog-size", "2000")  # fmt: skip
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    assert (ckpt / "config.json").is_file() and (ckpt / "catalog.json").is_file()
    out = tmp_path / "e2e.json"
    run = _bench("--engine", str(ckpt), "-n", "4", "--requests", "8", "--prompt-len", "24",
                 "--shared-prefix", "8", "--level-sizes", LEVELS, "--exclude-items", "50",
                 "--schedule", "decode_first", "--merge-beam-steps",
                 "--prefill-tokens-per-step", "16", "--trace-dir", str(tmp_path / "traces"),
                 "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text(), parse_constant=_not_json)
    assert result["path"] == "Engine.generate" and result["requests"] == 8
    assert (result["invalid_results"], result["short_results"]) == (0, 0)
    assert result["requests_per_s"] > 0 and result["exclude_items"] == 50
    assert 0 <= result["results_wait_share"] <= 1  # on the CPU copies land at once: near 0
    assert result["schedule"] == "decode_first"
    assert (result["prefill_attention"], result["prefill_tokens_per_step"]) == ("backend", 16)
    # decode-first: one wave in flight at a time, so merged steps (on) had nothing to merge
    assert result["merge_beam_steps"] and result["beam_forwards"] == result["beam_steps"] > 0
    # no GPU: no peaks to measure, so no floor (null, not NaN: the output stays strict JSON)
    assert result["percent_of_roofline"] is None and result["peak_memory_gib"] is None
    pool_slots = result["kv_pool_gib"] * 2**30 / _bytes_per_slot(ckpt)
    assert 0 < result["kv_slots_peak_used"] < pool_slots
    # --trace-dir: one more call of 8 requests under a profiler window, summed per loop phase
    trace = result["trace"]
    assert Path(trace["trace"]).is_file() and Path(trace["table"]).is_file()
    loop = trace["loop"]
    assert loop["iterations"] >= 3 and loop["gpu_busy_share"] is None  # prefill + 2 steps, CPU
    assert {"admit", "step", "results"} <= set(loop["phases"])
    assert "profile window: " + trace["trace"] in run.stderr
    # fresh prompts, as in the measured call: about their 8-token shared prefix of 24 cached
    # (a little more where random tokens of the small vocabulary happen to match); cached
    # prompts would give 23/24, all but the last token, which is always computed
    assert trace["cached_token_share"] < 0.5


def _not_json(constant: str) -> None:
    raise AssertionError(f"the bench printed {constant}, which is not JSON")


def _bytes_per_slot(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * head_dim * cfg["num_hidden_layers"] * 4  # fp32 on CPU
