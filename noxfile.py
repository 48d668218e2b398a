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
    """ruff check and ruff format --check (Python files and the code blocks of the docs)."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


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
