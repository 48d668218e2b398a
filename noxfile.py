"""Sessions: lint, core tests, one conformance session per model plugin (the CI matrix), gpu, bench.

nox                         # every default session, each in its own venv
nox --no-venv --no-install  # the same sessions in the current environment (what CI runs)
nox -s plugin-qwen3         # one plugin's conformance suite
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
PLUGINS = sorted(p.parent for p in ROOT.glob("flashrec_models_*/pyproject.toml"))
TORCH = "torch==2.13.0"  # on the CI machine pip takes the local CPU build of this version

nox.options.sessions = [
    "lint",
    "core",
    *[f"plugin-{p.name.removeprefix('flashrec_models_')}" for p in PLUGINS],
]


def _install(session: nox.Session, *plugins: Path) -> None:
    """Install torch, the core (with the dev extra) and the given plugins; skipped with
    --no-install in a passthrough (--no-venv) environment."""
    session.install(TORCH)
    session.install("-e", ".[dev]", *[arg for p in plugins for arg in ("-e", str(p))])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check (Python files and the code blocks of the docs), then
    the GPU-only code's calls checked against the APIs they call."""
    session.install("ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    _check_gpu_only_code(session)


GPU_ONLY = ("tests/gpu", "scripts")
"""Code no CPU run executes: the GPU test tier (skipped on CPU) and the device scripts."""
STALE_API = ("attr-defined", "call-arg", "name-defined")
"""mypy's codes for an attribute, a keyword argument or a name that does not exist."""


def _check_gpu_only_code(session: nox.Session) -> None:
    """Fail on GPU-only code that calls what no longer exists. Nothing on CPU runs it, so a
    renamed method or a removed option breaks it silently until a device run (session 21: two
    such test bugs cost a device call). Only mypy's stale-API codes count: the code is not typed
    to pass mypy as a whole. Without the project's dependencies (a bare nox venv) their types are
    unknown and fewer calls are checked; CI runs with everything installed."""
    out = session.run(
        "python", "-m", "mypy", *GPU_ONLY, "--ignore-missing-imports", "--follow-imports=silent",
        "--no-error-summary", "--hide-error-context", silent=True, success_codes=[0, 1],
    )  # fmt: skip
    stale = [line for line in (out or "").splitlines() if any(f"[{c}]" in line for c in STALE_API)]
    if stale:
        session.error("GPU-only code calls what does not exist:\n" + "\n".join(stale))


@nox.session
def core(session: nox.Session) -> None:
    """Core tests: registry, loader, search, kernels (Triton interpreter), CLI."""
    _install(session, *PLUGINS)
    session.run("python", "-m", "pytest", "-q", "tests", *session.posargs)


def _plugin_session(plugin: Path) -> None:
    name = f"plugin-{plugin.name.removeprefix('flashrec_models_')}"

    @nox.session(name=name)
    def run(session: nox.Session) -> None:
        _install(session, plugin)
        session.run("python", "-m", "pytest", "-q", str(plugin / "tests"), *session.posargs)


for _plugin in PLUGINS:
    _plugin_session(_plugin)


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU tier (on a CUDA machine): every test marked gpu, core and plugins (each plugin's
    ModelConformance carries the GPU tests: FlashInfer, Triton beam kernel, graphs, FP8)."""
    _install(session, *PLUGINS)
    session.run(
        "python", "-m", "pytest", "-q", "-m", "gpu", "tests", *[str(p / "tests") for p in PLUGINS]
    )


@nox.session
def bench(session: nox.Session) -> None:
    _install(session, *PLUGINS)
    session.run("flashrec", "bench", *session.posargs)
