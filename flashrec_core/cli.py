"""`flashrec` command line: models, generate, serve, bench, demo, recipe, eval, catalog convert.

Heavy imports (torch, transformers) happen inside the commands that need them, so
`flashrec models` stays fast and works without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashrec_core.recipe.commands import add_recipe_commands


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, LookupError, OSError, RuntimeError) as exc:
        print(f"flashrec {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """A user error as one line (pydantic's multi-line report becomes flag: value: reason)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        from flashrec_core.config import describe_settings_error

        return describe_settings_error(exc)
    return " ".join(str(exc).split())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashrec-core")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


# EngineConfig.schedule (config imports torch)
_SCHEDULES = ("interleaved", "decode_first", "admit_first")
_MEM_FRACTION = 0.7  # EngineConfig.mem_fraction's default (tests/core/test_cli.py checks)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashrec-core {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="list installed model plugins")
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(func=cmd_models)

    gen = sub.add_parser("generate", help="recommend items for one prompt (offline)")
    add_engine_args(gen)
    add_search_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (wrapped in the chat template if any)")
    prompt.add_argument("--messages-json", help="file with a JSON list of {role, content}")
    prompt.add_argument(
        "--input", help="JSONL file of API request bodies (chat or completions), one per line"
    )
    gen.add_argument("--output", help="with --input: write one response per line here")
    gen.add_argument("-n", type=int, default=10, help="beam width = number of ranked items")
    gen.add_argument("--max-tokens", type=int, default=None, help="must be >= the SID depth")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0: beam search; > 0: Gumbel top-k sampling at this temperature")  # fmt: skip
    gen.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling (--temperature > 0)"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/serving.md)")
    add_engine_args(serve)
    add_search_args(serve, named_catalogs=True)
    add_server_args(serve)
    _defaults_from_settings(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser(
        "bench", help="throughput and latency: the synthetic wave path (CUDA), --engine, --server"
    )
    bench.add_argument("--preset", default=None, help="model shape preset offered by a plugin")
    bench.add_argument("--config", default=None, help="config.json giving the model shape instead")
    bench.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens a request")
    bench.add_argument("--shared-prefix", type=int, default=64,
                       help="leading prompt tokens every request shares")  # fmt: skip
    bench.add_argument("-n", type=int, default=50, help="beam width")
    bench.add_argument("--requests", type=int, default=400, help="requests timed")
    bench.add_argument("--catalog-size", type=int, default=1_000_000,
                       help="items of the random catalog")  # fmt: skip
    bench.add_argument("--level-sizes", default="8192,8192,8192",
                       help="codebook size of each SID level, comma-separated")  # fmt: skip
    bench.add_argument("--rows-per-wave", type=int, default=None,
                       help="beam rows per decode wave (default 8192; with --engine, generate's "
                       "--max-wave-rows)")  # fmt: skip
    bench.add_argument("--no-fp8", action="store_true", help="BF16 weights and KV")
    bench.add_argument("--no-graphs", action="store_true",
                       help="eager beam steps (no CUDA graphs); with --engine, no CUDA graphs at all")  # fmt: skip
    add_beam_attention_args(bench)
    bench.add_argument("--no-hf-baseline", action="store_true",
                       help="skip the HF transformers beam-search baseline")  # fmt: skip
    bench.add_argument("--hf-requests", type=int, default=8, help="requests the baseline times")
    bench.add_argument("--hf-batch", type=int, default=4, help="the baseline's requests a batch")
    bench.add_argument("--out", default=None, help="write the results as JSON here")
    bench.add_argument(
        "--profile", default=None, help="write a torch.profiler table of one wave here"
    )
    e2e = bench.add_argument_group("end to end (docs/benchmarks.md)")
    e2e.add_argument("--write-checkpoint", metavar="DIR",
                     help="write the preset as a random-weight checkpoint dir + catalog, exit")  # fmt: skip
    e2e.add_argument("--engine", metavar="DIR", help="time Engine.generate on this checkpoint dir")
    e2e.add_argument("--server", metavar="URL", help="load a running flashrec serve")
    e2e.add_argument("--model-dir", help="with --server: the checkpoint it serves (vocab size)")
    e2e.add_argument("--rates", default="0.5,0.7,0.9,1.1",
                     help="open-loop rates: fractions of saturation (<= 1.5) or requests/s")  # fmt: skip
    e2e.add_argument("--concurrency", type=int, default=64, help="closed-loop saturation run")
    e2e.add_argument("--client-processes", type=int, default=None,
                     help="with --server: client processes sending the load (default: one per "
                     "32 concurrent requests, at most half the cores)")  # fmt: skip
    e2e.add_argument("--api-key", default=None, help="with --server: its API key, if it has one")
    e2e.add_argument("--profile-seconds", type=float, default=0.0, metavar="S",
                     help="with --server: a torch.profiler window of S seconds during each "
                     "open-loop rate (needs serve --torch-profile-dir); its loop summary is "
                     "printed and kept in --out")  # fmt: skip
    e2e.add_argument("--trace-dir", metavar="DIR", default=None,
                     help="with --engine: one more (untimed) Engine.generate call of the same size "
                     "under a torch.profiler window; its trace goes here and its loop summary is "
                     "printed and kept in --out")  # fmt: skip
    e2e.add_argument("--exclude-items", type=int, default=0,
                     help="with --engine: each request excludes this many random items")  # fmt: skip
    e2e.add_argument("--allow-items", type=int, default=0,
                     help="with --engine: each request allows only this many random items")  # fmt: skip
    e2e.add_argument("--schedule", choices=_SCHEDULES, default=None,
                     help="with --engine: the engine loop's schedule (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--prefill-tokens-per-step", type=int, default=None, metavar="T",
                     help="with --engine: chunked prefill (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--fp8-gemm-triton-rows", type=int, default=None, metavar="R",
                     help="with --engine: the Triton small-row GEMM (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--fp8-attention-scores", action="store_true", default=None,
                     help="with --engine: the experimental FP8 score dot of the beam kernel (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--host-threads", type=int, default=None, metavar="N",
                     help="with --engine: CPU threads of the loop (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--merge-beam-steps", action=argparse.BooleanOptionalAction, default=None,
                     help="with --engine: one forward for all waves' beam steps (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--mixed-prefill-steps", action=argparse.BooleanOptionalAction, default=None,
                     help="with --engine: prefills carry beam steps (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--mixed-prefill-tokens", type=int, default=None, metavar="T",
                     help="with --engine: the largest prefill that mixes (flashrec generate --help)")  # fmt: skip
    e2e.add_argument("--filter-categories", type=int, default=0,
                     help="with --engine: each request allows this many of the bench catalog's "
                     "100 item categories (an attribute filter)")  # fmt: skip
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="write a tiny random GenRec checkpoint + catalog")
    demo.add_argument("out", help="directory to create")
    demo.add_argument("--arch", default=None, help="architecture (default: first installed)")
    demo.add_argument("--items", type=int, default=1000, help="catalog size")
    demo.add_argument("--level-sizes", default="32,32,32", help="codebook sizes per level")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and the catalog")
    demo.set_defaults(func=cmd_demo)

    add_recipe_commands(sub)

    catalog = sub.add_parser("catalog", help="catalog tools")
    csub = catalog.add_subparsers(dest="catalog_command", required=True)
    conv = csub.add_parser("convert", help="RecIF packed-integer JSON -> 'c1,c2,c3' JSON")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--level-sizes", required=True, help="e.g. 8192,8192,8192")
    conv.set_defaults(func=cmd_catalog_convert)
    return parser


def add_beam_attention_args(p: argparse.ArgumentParser) -> None:
    """How beam steps and prefills attend (generate and bench alike)."""
    p.add_argument("--no-cascade", action="store_true", help="flat per-beam decode attention")
    p.add_argument(
        "--beam-attention", choices=["auto", "cascade", "triton"], default="auto",
        help="beam steps' attention: the one-pass Triton kernel or the backend's cascade "
        "(auto: Triton where it applies)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-attention", choices=["auto", "backend", "triton", "fresh"], default="auto",
        help="prompt prefills' attention: the Triton prefill kernel or the attention backend's "
        "over the cache, or 'fresh': over the prompt's own new K/V in the model's dtype through "
        "FlashInfer's ragged prefill (auto: fresh on sm90 with FlashInfer, else Triton where it "
        "applies)",
    )  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every entry point that loads a model (generate, bench, serve)."""
    p.add_argument(
        "--model-path", default=None,
        help="checkpoint directory (default: the embedded model with its catalog)",
    )  # fmt: skip
    p.add_argument("--arch", default=None, help="override config.json's architectures")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when torch sees one")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    p.add_argument("--quantization", choices=["auto", "fp8", "none"], default="auto",
                   help="fp8: W8A8 linears (auto: fp8 on CUDA or with a quantization_config)")  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", choices=["auto", "bfloat16", "float16", "float32", "fp8_e4m3"],
        default="auto", help="KV pool dtype (auto: fp8_e4m3 on CUDA with FP8, else --dtype's)",
    )  # fmt: skip
    p.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="auto: flashinfer on CUDA where it is installed, else torch")  # fmt: skip
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool size in token slots (default: from --mem-fraction on CUDA, "
                   "65,536 on CPU; docs/generate.md)")  # fmt: skip
    p.add_argument(
        "--mem-fraction", type=float, default=_MEM_FRACTION,
        help="the KV pool's share of the GPU memory free after the weights",
    )  # fmt: skip
    p.add_argument("--max-context", type=int, default=None, help="longest prompt in tokens")
    p.add_argument("--max-wave-rows", type=int, default=8192, help="beam rows per decode step")
    p.add_argument("--max-requests", type=int, default=1024, help="requests in flight at once")
    p.add_argument(
        "--schedule", choices=_SCHEDULES, default="interleaved",
        help="admit new waves at every step boundary (admit_first: and step them at once), or "
        "once the waves in flight have finished (decode_first)",
    )  # fmt: skip
    p.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run beam steps eagerly")
    p.add_argument(
        "--prefill-graph-tokens", type=int, default=8192, metavar="T",
        help="replay prefills of up to T new tokens as CUDA graphs (0: always eager)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-chunk-tokens", type=int, default=None, metavar="T",
        help="run a prefill as forwards of at most T new tokens each (default: 8184 with "
        "prefill graphs, so chunks replay the largest one; else 32768; 0: one forward)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-tokens-per-step", type=int, default=None, metavar="T",
        help="chunked prefill: while waves are in flight, run about T new prompt tokens of a new "
        "wave's prefill per loop iteration, the waves in flight stepping between the pieces "
        "(default: a wave's whole prefill at once)",
    )  # fmt: skip
    p.add_argument(
        "--fp8-gemm-triton-rows", type=int, default=None, metavar="R",
        help="FP8 projections of at most R rows (small beam steps) through the Triton "
        "small-row GEMM instead of cuBLAS; 0: never (default: as far as the GPU's launch "
        "table measured it faster, cuBLAS without one)",
    )  # fmt: skip
    p.add_argument(
        "--fp8-attention-scores", action="store_true",
        help="experimental: the Triton beam kernel's prompt score dot on FP8 tensor cores, "
        "queries rounded to e4m3 per row (an FP8 KV cache only)",
    )  # fmt: skip
    p.add_argument(
        "--host-threads", type=int, default=None, metavar="N",
        help="CPU threads of the thread running the engine loop (default: 1 on CUDA, all "
        "cores on CPU)",
    )  # fmt: skip
    p.add_argument(
        "--merge-beam-steps", action=argparse.BooleanOptionalAction, default=None,
        help="run the beam steps of the waves in flight as one model forward per loop "
        "iteration (each wave keeps its own selection); with CUDA graphs, small waves through "
        "one captured graph, and only where the Triton beam kernel runs the steps. Default: on "
        "where those graphs run (the CUDA default), off elsewhere",
    )  # fmt: skip
    p.add_argument(
        "--mixed-prefill-steps", action=argparse.BooleanOptionalAction, default=True,
        help="run an admitted wave's prefill and the beam steps of waves in flight as one "
        "model forward (each step's attention apart); with CUDA graphs only where "
        "--mixed-prefill-tokens is set. Default: on",
    )  # fmt: skip
    p.add_argument(
        "--mixed-prefill-tokens", type=int, default=0, metavar="T",
        help="with CUDA graphs, the most new prompt tokens of a prefill (of one or two "
        "requests) that carries beam steps, through mixed graphs per prefill bucket 512, "
        "1024, ... up to T (default 0: mix only where forwards run eagerly; slower on an "
        "H100 with 1,024-token prompts, docs/benchmarks.md session 29)",
    )  # fmt: skip
    add_beam_attention_args(p)
    p.add_argument(
        "--disable-fused", action="append", default=[], metavar="SWITCH",
        help="turn a fused path off, e.g. enable_fused_rms_fp8 (repeatable)",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="log engine decisions")


def add_search_args(p: argparse.ArgumentParser, named_catalogs: bool = False) -> None:
    if named_catalogs:
        p.add_argument(
            "--catalog", action="append", default=None, metavar="[NAME=]FILE",
            help="the default catalog FILE, or a further named catalog NAME=FILE (repeatable)",
        )  # fmt: skip
    else:
        p.add_argument("--catalog", default=None, help="catalog file (.json/.csv/.tsv)")
    p.add_argument("--sid-normalization", choices=["level", "sid"], default="level",
                   help="a step's log-softmax over its level's codes, or over every SID token "
                   "(docs/sid-and-catalogs.md)")  # fmt: skip
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="score = logprob / depth ** P")  # fmt: skip
    p.add_argument(
        "--sid-level-sizes", default=None, help="explicit codebook sizes, e.g. 256,256,256"
    )
    p.add_argument("--sid-depth", type=int, default=None,
                   help="use the first D codebook levels (default: all the tokenizer's)")  # fmt: skip
    p.add_argument("--trie", choices=["auto", "dense", "csr"], default="auto",
                   help="catalog trie layout (auto: dense while its tables fit 64 MiB, else csr)")  # fmt: skip


def _int_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", help="the model name clients send")
    p.add_argument("--max-queue", type=int, help="queued requests before 503 (default 1024)")
    p.add_argument("--default-n", type=int, help="n when a request sends none (default 10)")
    p.add_argument("--request-timeout", type=float, help="seconds before 504 (default: none)")
    p.add_argument("--shutdown-grace", type=float, help="seconds to drain on SIGTERM (default 30)")
    p.add_argument("--warmup-n", help="beam widths to warm up before /ready (default 10)")
    p.add_argument(
        "--admission-delay-factor", type=float,
        help="while waves run, admit a new one only after FACTOR x the last prefill's time "
        "since the last admission, so waves grow under load (default 0: every step)",
    )  # fmt: skip
    p.add_argument(
        "--gc-young-threshold", type=int, metavar="N",
        help="allocations between young garbage collections (default 10000; CPython's 700)",
    )  # fmt: skip
    p.add_argument(
        "--profile-engine", metavar="FILE",
        help="cProfile the engine thread; the stats are written to FILE at shutdown",
    )  # fmt: skip
    p.add_argument(
        "--torch-profile-dir", metavar="DIR",
        help="enable POST /start_profile and /stop_profile: torch.profiler traces of the engine "
        "thread are written to DIR",
    )  # fmt: skip
    p.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction,
        help="run the engine in a process of its own, apart from the HTTP side's GIL "
        "(default: on; --no-engine-process keeps one process)",
    )  # fmt: skip
    p.add_argument("--config", help="settings file (.json or .toml), see docs/serving.md")


def _defaults_from_settings(p: argparse.ArgumentParser) -> None:
    """`serve` flags carry no argparse defaults: a flag left out falls through to FLASHREC_*
    variables, then the config file, then the settings model's defaults."""
    for action in p._actions:
        if action.dest not in ("help", "func"):
            action.default = argparse.SUPPRESS
            action.required = False
    p.set_defaults(command="serve")


# flag dest -> EngineConfig field; "no_*" flags are inverted.
_ENGINE_FLAGS = {
    "model_path": "model_path", "arch": "arch", "device": "device", "dtype": "dtype",
    "quantization": "quantization", "kv_cache_dtype": "kv_cache_dtype",
    "attention_backend": "attention_backend", "kv_cache_tokens": "kv_cache_tokens",
    "mem_fraction": "mem_fraction", "max_context": "max_context", "max_wave_rows": "max_wave_rows",
    "max_requests": "max_requests", "schedule": "schedule",
    "no_prefix_cache": "prefix_cache", "no_cascade": "cascade_attention",
    "no_cuda_graphs": "cuda_graphs", "beam_attention": "beam_attention",
    "prefill_graph_tokens": "prefill_graph_tokens", "prefill_chunk_tokens": "prefill_chunk_tokens",
    "prefill_attention": "prefill_attention",
    "prefill_tokens_per_step": "prefill_tokens_per_step", "host_threads": "host_threads",
    "fp8_gemm_triton_rows": "fp8_gemm_triton_rows", "merge_beam_steps": "merge_beam_steps",
    "mixed_prefill_steps": "mixed_prefill_steps", "mixed_prefill_tokens": "mixed_prefill_tokens",
    "fp8_attention_scores": "fp8_attention_scores",
}  # fmt: skip
_SEARCH_FLAGS = {
    "catalog": "catalog_path", "sid_normalization": "sid_normalization",
    "length_penalty": "length_penalty", "trie": "trie_kind", "sid_level_sizes": "sid_level_sizes",
    "sid_depth": "sid_depth",
}  # fmt: skip
_SERVER_FLAGS = {
    "host": "host", "port": "port", "api_key": "api_key", "served_model_name": "served_model_name",
    "max_queue": "max_queue", "default_n": "default_n", "request_timeout": "request_timeout_s",
    "shutdown_grace": "shutdown_grace_s", "warmup_n": "warmup_n",
    "profile_engine": "profile_engine", "admission_delay_factor": "admission_delay_factor",
    "torch_profile_dir": "torch_profile_dir", "gc_young_threshold": "gc_young_threshold",
    "engine_process": "engine_process",
}  # fmt: skip


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of the engine flags given (all of them for generate/bench)."""
    given = vars(args)
    out: dict[str, Any] = {}
    for flag, fld in _ENGINE_FLAGS.items():
        if flag in given:
            out[fld] = not given[flag] if flag.startswith("no_") else given[flag]
    if "disable_fused" in given:
        switches = {s: False for s in given["disable_fused"] if s.startswith("enable_fused_")}
        from flashrec_core.config import EngineConfig

        out.update({k: v for k, v in switches.items() if k in EngineConfig.model_fields})
        out["disabled_fused"] = tuple(given["disable_fused"])
    return out


def search_fields(args: argparse.Namespace) -> dict[str, Any]:
    given = vars(args)
    out = {fld: given[flag] for flag, fld in _SEARCH_FLAGS.items() if flag in given}
    if "sid_level_sizes" in out:
        out["sid_level_sizes"] = _int_list(out["sid_level_sizes"])
    return out


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from flashrec_core.config import EngineConfig

    return EngineConfig(**engine_fields(args))


def search_config_from_args(args: argparse.Namespace) -> Any:
    from flashrec_core.config import SearchConfig

    return SearchConfig(**search_fields(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from flashrec_core.server.main import serve
    from flashrec_core.server.settings import load_settings

    logging.getLogger("flashrec.server").setLevel(logging.INFO)
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)
    given = vars(args)
    overrides: dict[str, Any] = {
        fld: given[flag] for flag, fld in _SERVER_FLAGS.items() if flag in given
    }
    if "warmup_n" in overrides:
        overrides["warmup_n"] = _int_list(overrides["warmup_n"])
    default, named = _split_catalogs(given.pop("catalog", None) or [])
    if default is not None:
        given["catalog"] = default
    if named:
        overrides["catalogs"] = named
    engine, search = engine_fields(args), search_fields(args)
    if engine:
        overrides["engine"] = engine
    if search:
        overrides["search"] = search
    try:
        settings = load_settings(overrides, given.get("config"))
    except ValidationError as exc:
        if not _lacks_model_path(exc):
            raise ValueError(_settings_error(exc)) from None
        settings = load_settings(_embedded_overrides(overrides), given.get("config"))
    return serve(settings)


def _split_catalogs(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """`--catalog FILE` (the default, once) and `--catalog NAME=FILE` (further named ones)."""
    import re

    default, named = None, {}
    for value in values:
        match = re.fullmatch(r"([A-Za-z0-9._-]{1,64})=(.+)", value)
        if match is None:
            if default is not None:
                raise ValueError(f"--catalog {value}: a second unnamed catalog; name it NAME=FILE")
            default = value
        elif match.group(1) in named or match.group(1) == "default":
            raise ValueError(f"--catalog {value}: the name {match.group(1)!r} is taken")
        else:
            named[match.group(1)] = match.group(2)
    return default, named


def _lacks_model_path(exc: Any) -> bool:
    """Whether no source (flag, environment, config file) named a model directory."""
    return any(
        e["type"] == "missing" and tuple(e["loc"]) in (("engine",), ("engine", "model_path"))
        for e in exc.errors()
    )


def _embedded_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Serve the embedded default model (and its catalog unless one is given); say so."""
    from flashrec_core.embedded import default_catalog_path, default_model_path

    path = default_model_path()
    print(
        f"flashrec: no model path given (--model-path, FLASHREC_ENGINE__MODEL_PATH or the config "
        f"file); serving the embedded default model ({path}): a small GenRec model of a "
        "synthetic food-ordering log; prompts are item ids, oldest first",
        file=sys.stderr,
    )
    search = {"catalog_path": str(default_catalog_path()), **overrides.get("search", {})}
    engine = {**overrides.get("engine", {}), "model_path": str(path)}
    return {
        "served_model_name": "flashrec-default",
        **overrides,
        "engine": engine,
        "search": search,
    }


def _settings_error(exc: Any) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    hint = ""
    if where == "engine" and first["type"] == "missing":
        where, hint = "engine.model_path", " (pass --model-path or set FLASHREC_ENGINE__MODEL_PATH)"
    return f"setting {where}: {first['msg']}{hint}"


def cmd_models(args: argparse.Namespace) -> int:
    from flashrec_core.registry import Registry

    registry = Registry.discover()
    if args.json:
        print(registry.as_json())
        return 0
    if not registry.plugins:
        print("no model plugins installed (pip install flashrec-models-<family>)")
    for p in registry.plugins:
        caps = ", ".join(c.name for c in p.spec.capabilities) if p.spec else "-"
        contract = f", contract v{p.contract}" if p.contract is not None else ""
        print(f"{p.name} ({p.distribution} {p.version}{contract}) [{p.status}]")
        print(f"  architectures: {', '.join(p.architectures)}")
        print(f"  fused paths:   {caps}")
        if p.error is not None:
            print(f"  error:         {type(p.error).__name__}: {p.error}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from flashrec_core.embedded import with_default_model
    from flashrec_core.engine.engine import Engine

    if args.output and not args.input:
        raise ValueError("--output goes with --input (a JSONL batch)")
    messages = _read_messages(args.messages_json) if args.messages_json else None
    args = with_default_model(args)
    engine = Engine.from_config(engine_config_from_args(args), search_config_from_args(args))
    if args.input:
        return _generate_batch(engine, args)
    depth = engine.trie.depth
    if args.max_tokens is not None and args.max_tokens < depth:
        raise ValueError(f"--max-tokens {args.max_tokens} is shorter than the SID depth {depth}")
    req = engine.make_request(args.prompt, messages, args.n, args.temperature, args.seed)
    [result] = engine.generate([req])
    catalog = engine.catalog
    if args.json:
        out = result.as_dict()
        for choice in out["choices"] if catalog is not None and catalog.metadata else ():
            choice["item_metadata"] = [catalog.metadata.get(i, {}) for i in choice["items"]]
        print(json.dumps(out, indent=2))
        return 0
    for c in result.choices:
        items = ", ".join(map(catalog.label, c.items)) if catalog and c.items else "-"
        print(f"{c.index + 1:>4}. {c.text}  items: {items}  logprob {c.logprob:.4f}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _generate_batch(engine: Any, args: argparse.Namespace) -> int:
    from flashrec_core.engine.heap import frozen_heap
    from flashrec_core.server.batch import run_batch
    from flashrec_core.server.translate import Defaults

    out = Path(args.output) if args.output else None
    with frozen_heap():  # each line's answer is built as the server builds it
        summary = run_batch(
            engine, Path(args.input), out, Defaults(n=args.n), Path(args.model_path).name
        )
    print(
        f"{summary.ok} answered, {summary.failed} error lines"
        + (f" -> {args.output}" if args.output else ""),
        file=sys.stderr,
    )
    return 0


def _read_messages(path: str) -> list[dict[str, str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--messages-json {path} is not valid UTF-8 (byte {exc.start}); re-save it as UTF-8"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--messages-json {path}: {exc}") from exc
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in data
    ):
        raise ValueError(f"--messages-json {path}: expected a list of {{role, content}} objects")
    return data


_BENCH_ENGINE_FLAGS = (
    "schedule", "prefill_tokens_per_step", "host_threads", "fp8_gemm_triton_rows",
    "merge_beam_steps", "mixed_prefill_steps", "mixed_prefill_tokens", "fp8_attention_scores",
)  # fmt: skip
"""`bench --engine`'s engine flags that map one to one onto EngineConfig fields."""


def _bench_engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields `bench --engine` sets away from their defaults (a flag not given is
    None)."""
    given = {f: getattr(args, f) for f in _BENCH_ENGINE_FLAGS}
    out = {f: v for f, v in given.items() if v is not None}
    if args.prefill_attention != "auto":
        out["prefill_attention"] = args.prefill_attention
    if args.no_graphs:
        out["cuda_graphs"] = False
    if args.rows_per_wave is not None:
        out["max_wave_rows"] = args.rows_per_wave
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from flashrec_core.bench.run import BenchConfig, main_bench

    level_sizes = _int_list(args.level_sizes)
    assert level_sizes is not None, "argparse supplies a default"
    if args.write_checkpoint or args.engine or args.server:
        return _bench_e2e(args, level_sizes)
    rows_per_wave = BenchConfig.rows_per_wave if args.rows_per_wave is None else args.rows_per_wave
    bc = BenchConfig(
        preset=args.preset, config_path=args.config, prompt_len=args.prompt_len,
        shared_prefix=args.shared_prefix, n=args.n, num_requests=args.requests,
        catalog_size=args.catalog_size, level_sizes=level_sizes, fp8=not args.no_fp8,
        cascade=not args.no_cascade, graphs=not args.no_graphs, rows_per_wave=rows_per_wave,
        beam_attention=args.beam_attention, prefill_attention=args.prefill_attention,
        hf_baseline=not args.no_hf_baseline, hf_requests=args.hf_requests, hf_batch=args.hf_batch,
        profile_path=args.profile,
    )  # fmt: skip
    main_bench(bc, args.out)
    return 0


def _bench_e2e(args: argparse.Namespace, level_sizes: tuple[int, ...]) -> int:
    from flashrec_core.bench import e2e
    from flashrec_core.bench.workload import (
        RequestSpec,
        load_shape,
        sid_layout_at_end,
        synthetic_requests,
    )

    if args.write_checkpoint:
        shape = load_shape(args.preset, args.config)
        path = e2e.write_bench_checkpoint(
            shape, level_sizes, args.catalog_size, Path(args.write_checkpoint)
        )
        print(f"wrote {path}")
        return 0
    if args.engine:
        result = e2e.bench_engine(
            Path(args.engine), args.n, args.requests, args.prompt_len, args.shared_prefix,
            level_sizes, exclude_items=args.exclude_items, allow_items=args.allow_items,
            filter_categories=args.filter_categories, engine_settings=_bench_engine_settings(args),
            trace_dir=Path(args.trace_dir) if args.trace_dir else None,
        )  # fmt: skip
        if "trace" in result:
            print(_window_text(result["trace"]), file=sys.stderr, flush=True)
    else:
        from flashrec_core.bench.load import run_server_bench, server_floor

        if not args.model_dir:
            raise ValueError("--server needs --model-dir (the checkpoint it serves)")
        vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
        layout = sid_layout_at_end(vocab, level_sizes)
        spec = RequestSpec(args.requests, args.prompt_len, args.shared_prefix, args.n)

        def prompts(run: int) -> list[list[int]]:
            reqs = synthetic_requests(spec, layout, seed=0, body_seed=500 + run)
            return [list(r.prompt_ids) for r in reqs]

        def progress(partial: dict[str, Any]) -> None:  # each phase as it ends (stderr, --out)
            print(_phase_line(partial), file=sys.stderr, flush=True)
            window = (partial.get("open_loop") or [{}])[-1].get("profile")
            if window is not None:
                print(_window_text(window), file=sys.stderr, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(partial, indent=2))

        rates = [float(x) for x in args.rates.split(",")]
        floor = server_floor(args.server, args.api_key, Path(args.model_dir), args.n, level_sizes)
        result = run_server_bench(
            args.server, prompts, args.n, rates, args.concurrency, args.api_key, floor,
            args.client_processes, progress, args.profile_seconds,
        )  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _window_text(window: dict[str, Any]) -> str:
    """A profiler window (an open-loop rate's, or bench --engine --trace-dir's): where its trace
    is, and the loop summary."""
    if "error" in window:
        return f"profile window failed: {window['error']}"
    text = f"profile window: {window['trace']}"
    if "loop" in window:
        from flashrec_core.bench.trace_summary import format_summary

        text += "\n" + format_summary(window["loop"])
    return text


def _phase_line(result: dict[str, Any]) -> str:
    """One line on the server bench's latest phase."""
    from flashrec_core.bench.load import STEADY_ROUNDS

    if result.get("open_loop"):
        run = result["open_loop"][-1]
        head = f"open loop {run['offered_rps']:.1f} req/s offered"
        if "arrival_span_s" in run:  # the achieved rate's span is this plus the last answer
            head += f" ({run['sent']} arrivals over {run['arrival_span_s']:.1f} s)"
    elif "saturation" in result:
        run = result["saturation"]
        head = f"closed loop, {run['concurrency']} in flight"
        if not run.get("steady_state", True):
            head += (f" (NOT a steady state: {run['sent']} requests, under "
                     f"{STEADY_ROUNDS}x the concurrency)")  # fmt: skip
    else:
        e = result["engine"]
        return (f"n={result['n']} unloaded: p50 {result['single_request_p50_ms']:.1f} ms, "
                f"p99 {result['single_request_p99_ms']:.1f} ms; mean in the server "
                f"{e['server_latency_mean_ms']:.1f} ms (intake {e['intake_mean_ms']:.2f}, queue "
                f"{e['queue_mean_ms']:.1f}, prefill {e['prefill_mean_ms']:.1f}, decode "
                f"{e['decode_mean_ms']:.1f}, shaping {e['shaping_mean_ms']:.2f}, handoff "
                f"{e['handoff_mean_ms']:.2f}); the client's JSON parse "
                f"{result.get('client_parse_mean_ms') or 0:.1f} ms")  # fmt: skip
    engine = run.get("engine", {})
    return (
        f"n={result['n']} {head}: {run['throughput_rps']:.1f} req/s, p50 "
        f"{run['latency_p50_ms'] or 0:.0f} / p99 {run['latency_p99_ms'] or 0:.0f} ms, "
        f"{run['errors']} errors, {engine.get('mean_requests_per_wave', 0):.1f} requests per "
        f"wave, engine busy {engine.get('engine_busy_fraction', 0):.2f} "
        f"({engine.get('mean_iteration_ms', 0):.1f} ms an iteration, CPU "
        f"{engine.get('engine_cpu_ms_per_iteration', 0):.1f}, waiting for results "
        f"{engine.get('results_wait_ms_per_iteration', 0):.1f}; "
        f"{engine.get('beam_forwards_per_step', 1):.2f} forwards a beam step), "
        f"server CPU outside the engine thread "
        f"{engine.get('other_cpu_ms_per_request', 0):.2f} ms a request"
        f"{_engine_process_share(engine)}, admissions put back "
        f"{engine.get('admission_retries_kv_slots', 0)} (KV) / "
        f"{engine.get('admission_retries_device_memory', 0)} (device memory), garbage "
        f"collector {engine.get('gc_pause_ms_per_s', 0):.1f} ms a second "
        f"({engine.get('gc_full_collections', 0)} full, {engine.get('gc_full_pause_mean_ms', 0):.1f}"
        f" ms each)"
    )


def _engine_process_share(engine: dict[str, Any]) -> str:
    """With --engine-process: the part of that CPU spent in the engine process (its pipe and
    command threads), the rest being the HTTP process's."""
    if "engine_process_other_cpu_ms_per_request" not in engine or not engine.get("own_process"):
        return ""
    return f" (engine process {engine['engine_process_other_cpu_ms_per_request']:.2f})"


def cmd_demo(args: argparse.Namespace) -> int:
    from flashrec_core.demo import write_demo

    level_sizes = _int_list(args.level_sizes)
    assert level_sizes is not None, "argparse supplies a default"
    path = write_demo(Path(args.out), args.arch, level_sizes, args.items, args.seed)
    print(f"wrote {path} (config.json, model.safetensors, tokenizer, catalog.json)")
    return 0


def cmd_catalog_convert(args: argparse.Namespace) -> int:
    from flashrec_core.search import convert_packed_catalog

    level_sizes = _int_list(args.level_sizes)
    assert level_sizes is not None, "--level-sizes is required"
    catalog = convert_packed_catalog(args.src, args.dst, level_sizes)
    print(f"wrote {args.dst}: {len(catalog)} SIDs, {catalog.num_items} items")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
