"""pytest plugin (entry point `pytest11`): fixtures and parametrization for the conformance suite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


SLOW_PHASE_S = 5.0
"""With FLASHREC_INSTANT_FAILURES=1, a test phase longer than this is reported as it ends."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """FLASHREC_INSTANT_FAILURES=1 (the GPU runs): print each failure, and each phase slower
    than SLOW_PHASE_S, as it happens: a device run is cut off by a time limit before pytest's
    summary (and its --durations table) would print."""
    if os.environ.get("FLASHREC_INSTANT_FAILURES") != "1":
        return
    if report.failed:
        print(f"\n!!! {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}", flush=True)
    if report.duration > SLOW_PHASE_S:
        print(f"\nSLOW {report.nodeid} ({report.when}) {report.duration:.1f} s", flush=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `example` over the class's spec examples."""
    spec = getattr(metafunc.cls, "spec", None)
    if spec is not None and "example" in metafunc.fixturenames:
        metafunc.parametrize("example", spec.examples, ids=[e.name for e in spec.examples])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request: pytest.FixtureRequest):
    """After each GPU test, hand its engines' memory (KV pool, FlashInfer workspace) back to the
    driver: GPU tiers run under pytest-xdist, and cached blocks of one worker would starve the
    others into out-of-memory errors that are no fault of the code under test."""
    yield
    if "gpu" in request.keywords:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory: (spec, example, level_sizes=(16,16,16)) -> (checkpoint dir, fp32 HF model).

    Cached per session: each example checkpoint is written once by transformers."""
    from flashrec_core.testing.checkpoint import spec_norm_identity, write_tiny_checkpoint

    cache: dict[Any, tuple[Path, Any]] = {}

    def make(
        spec: Any, example: Any, level_sizes: tuple[int, ...] = (16, 16, 16),
        hf_config: Any = None, tag: str = "",
    ):  # fmt: skip
        """hf_config replaces the example's (e.g. its GPU shape); tag keys that variant."""
        key = (spec.name, example.name, level_sizes, tag)
        if key not in cache:
            config = hf_config if hf_config is not None else example.hf_config
            path = tmp_path_factory.mktemp(f"{spec.name}-{example.name}{tag}")
            hf = write_tiny_checkpoint(
                path, config, level_sizes=level_sizes,
                norm_identity=spec_norm_identity(spec, config),
            )  # fmt: skip
            cache[key] = (path, hf)
        return cache[key]

    return make
