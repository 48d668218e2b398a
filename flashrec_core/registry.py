"""Discovery of model plugins through the `flashrec.models` entry-point group.

Every process discovers plugins afresh from installed metadata; the core never imports a plugin by
name. A plugin that fails to import is recorded, not fatal: its error is re-raised (chained) only
when one of its architectures is requested, so the other plugins keep working. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from flashrec_core.spec import (
    CONTRACT_VERSION,
    SUPPORTED_CONTRACTS,
    ConfigError,
    ModelConfig,
    ModelSpec,
)

ENTRY_POINT_GROUP = "flashrec.models"


class RegistryError(LookupError):
    """An architecture cannot be resolved to exactly one working plugin."""


@dataclass(frozen=True)
class PluginInfo:
    """One discovered entry point: its spec when it loaded, its error when it did not."""

    name: str
    distribution: str
    version: str
    spec: ModelSpec | None
    error: BaseException | None
    architectures: tuple[str, ...]

    @property
    def status(self) -> str:
        return "ok" if self.error is None else "error"

    @property
    def contract(self) -> int | None:
        """The model contract version the plugin was written against (None: it did not load)."""
        return None if self.spec is None else self.spec.contract_version

    def as_dict(self) -> dict[str, Any]:
        caps = [c.name for c in self.spec.capabilities] if self.spec else []
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "architectures": list(self.architectures),
            "capabilities": caps,
            "contract": self.contract,
            "status": self.status,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
        }


def _load_plugin(eps: list[EntryPoint]) -> PluginInfo:
    """Load one plugin: the entry points (one per architecture) that share a target object."""
    ep = eps[0]
    dist = ep.dist.name if ep.dist is not None else "<unknown>"
    version = ep.dist.version if ep.dist is not None else "?"
    declared = tuple(sorted(e.name for e in eps))
    module = ep.value.split(":")[0].split(".")[0]
    try:
        spec = ep.load()
        _check_spec(spec, dist, declared)
    except Exception as exc:  # a broken plugin must not take the others down
        return PluginInfo(module, dist, version, None, exc, declared)
    return PluginInfo(spec.name, dist, version, spec, None, declared)


def _check_spec(spec: Any, dist: str, declared: tuple[str, ...]) -> None:
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{dist}: entry point does not export a ModelSpec (got {type(spec)!r})")
    if set(spec.architectures) != set(declared):
        raise RuntimeError(
            f"{dist}: entry-point names {list(declared)} differ from the spec's architectures "
            f"{list(spec.architectures)}; register one entry point per architecture"
        )
    if spec.contract_version not in SUPPORTED_CONTRACTS:
        supported = ", ".join(f"v{v}" for v in SUPPORTED_CONTRACTS)
        raise RuntimeError(
            f"{dist} was written for FlashRec model contract v{spec.contract_version}, "
            f"this flashrec-core (contract v{CONTRACT_VERSION}) loads {supported}; upgrade one "
            "of them"
        )


class Registry:
    """The plugins installed in this environment, indexed by architecture."""

    def __init__(self, plugins: list[PluginInfo]) -> None:
        self.plugins = plugins

    @classmethod
    def discover(cls) -> Registry:
        groups: dict[tuple[str, str], dict[str, EntryPoint]] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else ""
            # NOTE: keyed by name too, so a distribution visible twice on sys.path counts once.
            groups.setdefault((dist, ep.value), {}).setdefault(ep.name, ep)
        plugins = [_load_plugin(list(g.values())) for _, g in sorted(groups.items())]
        return cls(plugins)

    def architectures(self) -> list[str]:
        return sorted({a for p in self.plugins for a in p.architectures})

    def resolve(self, architecture: str) -> ModelSpec:
        """The spec serving `architecture`; a clear error when none or several claim it."""
        claims = [p for p in self.plugins if architecture in p.architectures]
        if not claims:
            installed = ", ".join(self.architectures()) or "none"
            raise RegistryError(
                f"unknown architecture '{architecture}'. Installed: {installed}. Install the "
                "plugin that serves it (`pip install flashrec-models-<family>`, e.g. "
                f"`pip install {_package_hint(architecture)}` if that family has its own "
                "package) or pass --arch with an installed architecture."
            )
        if len(claims) > 1:
            names = ", ".join(f"{p.distribution} ({p.name})" for p in claims)
            raise RegistryError(
                f"architecture '{architecture}' is claimed by several plugins: {names}; "
                "uninstall all but one"
            )
        plugin = claims[0]
        if plugin.error is not None:
            raise RegistryError(
                f"plugin '{plugin.name}' from {plugin.distribution} serves {architecture} but "
                f"failed to import: {plugin.error}"
            ) from plugin.error
        assert plugin.spec is not None, "a plugin without error has a spec"
        return plugin.spec

    def as_json(self) -> str:
        return json.dumps([p.as_dict() for p in self.plugins], indent=2)


def _package_hint(architecture: str) -> str:
    family = architecture.removesuffix("ForCausalLM").lower() or architecture.lower()
    return f"flashrec-models-{family}"


def read_architecture(model_path: str | Path, override: str | None = None) -> str:
    """`--arch` when given, else the single entry of config.json's `architectures`."""
    if override:
        return override
    config = load_hf_config(model_path)
    archs = config.get("architectures") or []
    if len(archs) != 1:
        raise RegistryError(
            f"{Path(model_path) / 'config.json'}: field 'architectures' is {archs!r}; "
            "expected exactly one name; pass --arch <Name>ForCausalLM"
        )
    return archs[0]


def load_hf_config(model_path: str | Path) -> Mapping[str, Any]:
    """Read config.json of a checkpoint directory with errors that name the file."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; --model-path must be a checkpoint dir")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_model_config(
    model_path: str | Path, arch: str | None = None, registry: Registry | None = None
) -> tuple[ModelSpec, ModelConfig]:
    """The plugin serving a checkpoint and its parsed config; a bad field is an error naming
    config.json's path (checked before anything else, e.g. a tokenizer, reads the file)."""
    registry = registry or Registry.discover()
    spec = registry.resolve(read_architecture(model_path, arch))
    hf_config = load_hf_config(model_path)
    try:
        return spec, spec.parse_config(hf_config)
    except ConfigError as exc:
        raise ConfigError(f"{Path(model_path) / 'config.json'}: {exc}") from exc
