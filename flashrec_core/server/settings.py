"""Server settings: one pydantic-settings model composing EngineConfig and SearchConfig.

Sources, highest first: `flashrec serve` flags, FLASHREC_* environment variables (nested with
`__`: FLASHREC_ENGINE__MODEL_PATH, FLASHREC_SEARCH__CATALOG_PATH; flat for the server's own:
FLASHREC_PORT, FLASHREC_API_KEY), a config file (`--config FILE` or FLASHREC_CONFIG; JSON or
TOML, the same nesting), then defaults. pydantic-settings was chosen because it does exactly this
layering with the same validation the engine configs already use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from flashrec_core.config import EngineConfig, SearchConfig


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FLASHREC_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    engine: EngineConfig
    search: SearchConfig = SearchConfig()
    host: str = "127.0.0.1"
    """Loopback by default: expose it deliberately (behind a proxy, docs/serving.md)."""
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    """When set, every /v1 request needs `Authorization: Bearer KEY`."""
    served_model_name: str | None = None
    """The `model` name clients send; default: the checkpoint directory's name."""
    max_queue: int = Field(default=1024, ge=1)
    """Requests waiting for admission before new ones get 503 + Retry-After."""
    default_n: int = Field(default=10, ge=1)
    """Beam width when a request sends no `n`."""
    request_timeout_s: float | None = Field(default=None, gt=0)
    """Deadline for requests that send no `timeout` (504 when it passes); None: no deadline."""
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: how long requests in flight may take to finish before they are cancelled."""
    catalogs: dict[str, str] = {}
    """Further named catalogs, name -> file (`--catalog NAME=FILE`); the default one is
    `search.catalog_path`. Requests pick one with their `catalog` field."""
    warmup_n: tuple[int, ...] = (10,)
    """Beam widths run once before /ready (captures their CUDA graphs on a GPU)."""
    admission_delay_factor: float = Field(default=0.0, ge=0.0, le=100.0)
    """While waves are in flight, admit a new wave only once FACTOR x the last prefill's time
    has passed since the last admission (vLLM's scheduler delay factor): under load fewer,
    larger waves share each forward's fixed cost, for at most that much more queueing. 0 admits
    at every step boundary; an idle engine never waits."""
    gc_young_threshold: int = Field(default=10_000, ge=100)
    """Allocations (net of frees) between collections of the cyclic collector's youngest
    generation (CPython's default is 700). Every collection holds the GIL, and at 700 a loaded
    server's requests in flight outlive two young collections and then take part in every full
    one: 31-35 ms each at 800 in flight on the GPU machine. At 10,000 most requests finish
    before a young collection sees them (engine/heap.py)."""
    engine_process: bool = True
    """Run the engine (weights, device, loop) in a process of its own; this process keeps HTTP,
    validation, tokenizing and the shaping of answers, so none of that Python holds the engine
    thread's GIL (server/engine_process.py; docs/serving.md). On by default: on an H100 at n=50
    it held 96-97% of `Engine.generate` at saturation where one process held 88-90%
    (docs/benchmarks.md, session 34). `--no-engine-process` keeps one process (a catalog's host
    memory once, one model load)."""
    log_requests: bool = True
    profile_engine: Path | None = None
    """cProfile the engine thread and write the stats (cumulative, text) here at shutdown."""
    torch_profile_dir: Path | None = None
    """Enables POST /start_profile and /stop_profile: a torch.profiler window over the engine
    thread (its operations and, on a GPU, kernels), written here as a Chrome trace and a text
    table when it stops. Without it those routes answer 404."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("toml_file"):
            sources.append(TomlConfigSettingsSource(settings_cls))
        if settings_cls.model_config.get("json_file"):
            sources.append(JsonConfigSettingsSource(settings_cls))
        return tuple(sources)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model_path).name


def load_settings(overrides: dict[str, Any], config_file: str | None = None) -> ServerSettings:
    """Settings from flags (`overrides`, nested like the model), env and the config file."""
    path = config_file or os.environ.get("FLASHREC_CONFIG")
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"config file {path} does not exist (--config / FLASHREC_CONFIG)"
            )
        if not path.endswith((".json", ".toml")):
            raise ValueError(f"config file {path}: use a .json or .toml file")
    cls: type[ServerSettings] = ServerSettings
    if path is not None:
        key = "toml_file" if path.endswith(".toml") else "json_file"

        class _FromFile(ServerSettings):
            model_config = SettingsConfigDict(**{**ServerSettings.model_config, key: path})

        cls = _FromFile
    return cls(**overrides)
