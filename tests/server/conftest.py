"""A live `flashrec serve` (a real process on 127.0.0.1) over a tiny Qwen3 GenRec checkpoint, and
an in-process engine on the same files to compare answers with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.testing.server_process import ServerProcess

API_KEY = "test-key-123"
LEVELS = (32, 32, 32)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrec_core.demo import write_demo

    path = tmp_path_factory.mktemp("serve") / "genrec-tiny"
    write_demo(path, "Qwen3ForCausalLM", LEVELS, num_items=1500, seed=3)
    return path


def server_args(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--model-path", str(checkpoint), "--catalog", str(checkpoint / "catalog.json"),
        "--device", "cpu", "--kv-cache-tokens", "65536", "--api-key", API_KEY, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess(server_args(checkpoint)) as proc:
        yield proc


@pytest.fixture(scope="session")
def engine(checkpoint: Path) -> Engine:
    cfg = EngineConfig(
        model_path=str(checkpoint), device="cpu", kv_cache_tokens=65536, show_progress=False
    )
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(checkpoint / "catalog.json")))


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
