"""`flashrec demo` + `flashrec generate` end to end, and the errors a user can cause."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashrec_core.cli import _build_parser, main


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "model"
    assert main(["demo", str(path), "--items", "300", "--level-sizes", "16,16,16"]) == 0
    return path


def _generate(demo: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["generate", "--model-path", str(demo), "--device", "cpu", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_returns_ranked_catalog_items(demo: Path, capsys) -> None:
    catalog = json.loads((demo / "catalog.json").read_text())
    code, out, _ = _generate(
        demo,
        capsys,
        "--catalog",
        str(demo / "catalog.json"),
        "--prompt",
        "user w1 w2",
        "-n",
        "7",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    choices = result["choices"]
    assert len(choices) == 7 and [c["index"] for c in choices] == list(range(7))
    assert set(choices[0]) == {"index", "text", "token_ids", "items", "logprob", "score"}
    logprobs = [c["logprob"] for c in choices]
    assert logprobs == sorted(logprobs, reverse=True)
    for c in choices:
        codes = ",".join(part.split("_")[2] for part in c["text"].strip("<>").split("><"))
        assert c["items"] == [catalog[codes]], "items must be the catalog's ids for that SID"
        assert len(c["token_ids"]) == 3
        assert c["score"] == pytest.approx(c["logprob"] / 3)
    assert result["usage"]["completion_tokens"] == 21


def test_generate_messages_json_and_text_output(demo: Path, tmp_path: Path, capsys) -> None:
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "history w3 w4"}]))
    code, out, _ = _generate(
        demo,
        capsys,
        "--catalog",
        str(demo / "catalog.json"),
        "--messages-json",
        str(messages),
        "-n",
        "3",
    )
    assert code == 0 and out.count("items: item-") == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--catalog", "/nonexistent.json", "--prompt", "w1"], "/nonexistent.json"),
        (["--prompt", "w1", "--max-tokens", "2"], "--max-tokens 2 is shorter than the SID depth 3"),
        (["--prompt", "w1", "--arch", "NopeForCausalLM"], "unknown architecture 'NopeForCausalLM'"),
        (["--prompt", "w1", "--sid-level-sizes", "16,8,16"], "16"),
    ],
    ids=["missing-catalog", "max-tokens", "unknown-arch", "level-size-conflict"],
)
def test_generate_errors_name_the_problem(
    demo: Path, capsys, args: list[str], message: str
) -> None:
    code, _, err = _generate(demo, capsys, *args)
    assert code == 2
    assert message in err, err


def test_bad_catalog_key_is_named(demo: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1,2,3": "a", "1,99,3": "b"}))
    code, _, err = _generate(demo, capsys, "--catalog", str(bad), "--prompt", "w1")
    assert code == 2 and "1,99,3" in err and str(bad) in err


def test_missing_model_path_is_named(tmp_path: Path, capsys) -> None:
    code = main(
        ["generate", "--model-path", str(tmp_path / "nope"), "--prompt", "w1", "--device", "cpu"]
    )
    assert code == 2 and str(tmp_path / "nope") in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [((), {"schedule": "interleaved", "cuda_graphs": True,
           "prefill_attention": "auto", "prefill_tokens_per_step": None}),
     (("--schedule", "decode_first", "--no-cuda-graphs",
       "--prefill-attention", "backend", "--prefill-tokens-per-step", "2048"),
      {"schedule": "decode_first", "cuda_graphs": False,
       "prefill_attention": "backend", "prefill_tokens_per_step": 2048})],
)  # fmt: skip
def test_engine_flags_reach_the_engine_config(flags: tuple[str, ...], expected: dict) -> None:
    from flashrec_core.cli import _bench_engine_settings, _build_parser, engine_fields
    from flashrec_core.config import EngineConfig

    args = _build_parser().parse_args(["generate", "--prompt", "w1", "--model-path", "/m", *flags])
    cfg = EngineConfig(**engine_fields(args))
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.mem_fraction == EngineConfig.model_fields["mem_fraction"].default  # same default
    # bench --engine takes the other engine flags (not --no-cuda-graphs: --no-graphs)
    bench = [f for f in flags if f != "--no-cuda-graphs"]
    args = _build_parser().parse_args(["bench", "--engine", "/m", *bench])
    cfg = EngineConfig(model_path="/m", **_bench_engine_settings(args))
    fields = ("schedule", "prefill_attention", "prefill_tokens_per_step")
    assert {k: getattr(cfg, k) for k in fields} == {k: expected[k] for k in fields}


@pytest.mark.parametrize(("flags", "rows"), [((), 8192), (("--rows-per-wave", "16384"), 16384)])
def test_bench_rows_per_wave_sets_both_paths(flags: tuple[str, ...], rows: int) -> None:
    """`bench --rows-per-wave` bounds the synthetic path's waves and, with --engine, the engine's
    beam rows a step (generate's --max-wave-rows); not given, both keep their default."""
    from flashrec_core.bench.run import BenchConfig
    from flashrec_core.cli import _bench_engine_settings, _build_parser
    from flashrec_core.config import EngineConfig

    args = _build_parser().parse_args(["bench", "--engine", "/m", *flags])
    assert EngineConfig(model_path="/m", **_bench_engine_settings(args)).max_wave_rows == rows
    assert BenchConfig.rows_per_wave == EngineConfig.model_fields["max_wave_rows"].default


@pytest.mark.parametrize(
    ("flags", "graphs", "mixed", "tokens"),
    [((), True, True, 0), (("--no-mixed-prefill-steps",), True, False, 0),
     (("--no-graphs",), False, True, 0),
     (("--no-graphs", "--no-mixed-prefill-steps"), False, False, 0),
     (("--mixed-prefill-tokens", "2048"), True, True, 2048)],
)  # fmt: skip
def test_bench_engine_takes_graphs_and_mixed_prefills(
    flags: tuple[str, ...], graphs: bool, mixed: bool, tokens: int
) -> None:
    """`bench --engine` takes `--[no-]mixed-prefill-steps`, `--mixed-prefill-tokens` and
    `--no-graphs` (CUDA graphs off, where mixed prefills run eagerly); generate takes the
    mixed-prefill flags too."""
    from flashrec_core.cli import _bench_engine_settings, _build_parser, engine_fields
    from flashrec_core.config import EngineConfig

    args = _build_parser().parse_args(["bench", "--engine", "/m", *flags])
    cfg = EngineConfig(model_path="/m", **_bench_engine_settings(args))
    got = (cfg.cuda_graphs, cfg.mixed_prefill_steps, cfg.mixed_prefill_tokens)
    assert got == (graphs, mixed, tokens)
    gen = [f for f in flags if f != "--no-graphs"]
    args = _build_parser().parse_args(["generate", "--prompt", "w1", "--model-path", "/m", *gen])
    cfg = EngineConfig(**engine_fields(args))
    assert (cfg.mixed_prefill_steps, cfg.mixed_prefill_tokens) == (mixed, tokens)


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    """(command path, action) of every option of `parser` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings:
            yield path, action


def test_every_flag_says_what_it_does() -> None:
    """`--help` is the first documentation a user reads: no option may show up there bare."""
    options = list(_options(_build_parser(), "flashrec"))
    assert len(options) > 100  # the walk reached the subcommands
    bare = [f"{path} {a.option_strings[-1]}" for path, a in options if not a.help]
    assert not bare, f"options without a help text: {bare}"
