"""The ModelSpec protocol: everything the engine knows about a model family.

A plugin package exports one `ModelSpec` object through the `flashrec.models` entry-point group.
The core reads a checkpoint only through it: which architectures it serves, how config.json
becomes a validated `ModelConfig`, which checkpoint tensors merge into which fused parameter, which
fused kernel paths the structure allows, and which class builds the model.

This module must stay importable without torch (the registry lists plugins in processes that never
load a model), so the model class and kernels are referenced by import strings and loaded lazily.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    import torch


CONTRACT_VERSION = 1
"""Bumped when the spec or model-class contract changes incompatibly; plugins declare the version
they were written against and the registry refuses a mismatch."""


class ConfigError(ValueError):
    """A config.json field is missing, malformed or unsupported."""


class RopeConfig(BaseModel):
    """Rotary embedding parameters in FlashRec's vocabulary (HF `rope_scaling` is read in from_hf)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    theta: float
    rotary_dim: int
    scaling_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class QuantizationConfig(BaseModel):
    """What a checkpoint's `quantization_config` says about its stored weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["fp8"]
    activation_scheme: Literal["dynamic"] = "dynamic"
    ignored_modules: tuple[str, ...] = ()


class ModelConfig(BaseModel):
    """Fields every model has, in FlashRec's names. Plugins subclass it with structural flags.

    The engine reads only these fields (KV pool, attention shapes, LM head); everything else a
    family needs lives in the plugin's subclass. Frozen: nothing mutates a config after parsing.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    tie_word_embeddings: bool
    rope: RopeConfig
    norm_eps: float
    checkpoint_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    quantization: QuantizationConfig | None = None


@dataclass(frozen=True)
class Bucket:
    """One fused parameter built from several checkpoint tensors, concatenated on the output dim.

    `param` and `sources` are module-path suffixes relative to a layer (e.g. "self_attn.qkv_proj"
    <- "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"). Shard i lands at the row offset
    given by the fused module's `output_sizes[:i]`.
    """

    param: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class WeightMap:
    """Declarative checkpoint -> parameter mapping; one table drives the loader and the tests."""

    buckets: tuple[Bucket, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    """(checkpoint prefix, parameter prefix) pairs applied before bucket matching."""
    ignore: tuple[str, ...] = ()
    """Regular expressions (re.fullmatch) of checkpoint keys that are read past on purpose."""
    tied: tuple[tuple[str, str], ...] = ()
    """(parameter, source parameter) pairs that share storage when `tie_word_embeddings` is true;
    a checkpoint copy of the tied parameter is accepted and ignored."""


@dataclass(frozen=True)
class FusedPath:
    """A fused kernel path by what it does, with the kernel that implements it.

    `switch` is the user flag (`enable_fused_*`) that can turn it off. `kernel` is an import string
    "module:function" loaded only when the path is enabled. `requires` lists static preconditions
    checked once at build time: "fp8_linear" (W8A8 GEMMs are on), "fp8_kv" (the KV pool is FP8),
    "triton" (a Triton backend: CUDA, or TRITON_INTERPRET=1).
    """

    name: str
    switch: str
    kernel: str
    description: str
    requires: tuple[str, ...] = ("triton",)

    def load_kernel(self) -> Any:
        module, _, attr = self.kernel.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ExampleConfig:
    """A tiny HF config (as a dict) the conformance suite builds random checkpoints from."""

    name: str
    hf_config: Mapping[str, Any]


@runtime_checkable
class ModelSpec(Protocol):
    """What a plugin exports. See docs/adding-a-model.md."""

    name: str
    contract_version: int
    architectures: tuple[str, ...]
    weight_map: WeightMap
    capabilities: tuple[FusedPath, ...]
    model_class: str
    """Import string "module:Class" of the model; imported lazily by `load_model_class`."""
    examples: tuple[ExampleConfig, ...]
    hf_config_class: str
    """Import string of the transformers config class used as the parity oracle in tests."""

    def parse_config(self, hf_config: Mapping[str, Any]) -> ModelConfig: ...

    def load_model_class(self) -> type[torch.nn.Module]: ...


@dataclass(frozen=True)
class BaseModelSpec:
    """A convenient concrete ModelSpec: plugins instantiate it and supply `config_parser`."""

    name: str
    architectures: tuple[str, ...]
    config_parser: Any
    """Callable(dict) -> ModelConfig; raise ConfigError or pydantic ValidationError on bad input."""
    weight_map: WeightMap
    model_class: str
    hf_config_class: str
    capabilities: tuple[FusedPath, ...] = ()
    examples: tuple[ExampleConfig, ...] = ()
    contract_version: int = CONTRACT_VERSION
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def parse_config(self, hf_config: Mapping[str, Any]) -> ModelConfig:
        try:
            return self.config_parser(hf_config)
        except ValidationError as exc:
            raise ConfigError(_describe_validation_error(self.name, exc)) from exc

    def load_model_class(self) -> type[torch.nn.Module]:
        module, _, attr = self.model_class.partition(":")
        return getattr(importlib.import_module(module), attr)

    def capability(self, name: str) -> FusedPath | None:
        return next((c for c in self.capabilities if c.name == name), None)


def _describe_validation_error(spec_name: str, exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = prefix + (".".join(str(p) for p in err["loc"]) or "<root>")
        parts.append(f"field '{loc}': {err['msg']} (got {err.get('input')!r})")
    return f"{spec_name}: invalid config.json: " + "; ".join(parts)


def require_field(
    hf_config: Mapping[str, Any], key: str, arch: str, kind: type | None = None
) -> Any:
    """Read a mandatory HF config field, converted to `kind` (int, float, bool) when given; a
    missing or mistyped one is an error that names the config.json key."""
    if key not in hf_config or hf_config[key] is None:
        raise ConfigError(
            f"{arch}: config.json lacks required field '{key}'; add it to config.json "
            f"(FlashRec does not guess it from another model family's default)"
        )
    value = hf_config[key]
    return value if kind is None else as_type(value, kind, key, arch)


def optional_field(
    hf_config: Mapping[str, Any], key: str, arch: str, kind: type, default: Any
) -> Any:
    """Read an optional HF config field with the family's own default, type-checked."""
    value = hf_config.get(key)
    return default if value is None else as_type(value, kind, key, arch)


def as_type(value: Any, kind: type, key: str, arch: str) -> Any:
    """Convert a JSON value to int/float/bool strictly: "abc", 3.5 for an int, or "true" fail."""
    ok = {
        int: isinstance(value, int)
        and not isinstance(value, bool)
        or isinstance(value, float)
        and value.is_integer(),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
    }.get(kind, isinstance(value, kind))
    if not ok:
        raise ConfigError(
            f"{arch}: config.json field '{key}' must be {kind.__name__}, got {value!r}"
        )
    return kind(value)


def parse_rope(hf_config: Mapping[str, Any], head_dim: int, arch: str) -> RopeConfig:
    """Read rope_theta / rope_scaling (or transformers 5's rope_parameters) into a RopeConfig."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = dict(hf_config.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = merged.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{arch}: config.json lacks 'rope_theta'")
    theta = as_type(theta, float, "rope_theta", arch)
    factor = hf_config.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0))
    factor = as_type(factor, float, "partial_rotary_factor", arch)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ConfigError(
            f"{arch}: partial_rotary_factor={factor} gives odd or empty rotary dim {rotary_dim}"
        )
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(
            f"{arch}: rope_scaling type '{kind}' is not supported "
            "(supported: default, linear, llama3, yarn)"
        )
    fields: dict[str, Any] = {"theta": theta, "rotary_dim": rotary_dim, "scaling_type": kind}
    names = {
        "factor": "factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_max_position_embeddings": "original_max_position",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "attention_factor": "attention_factor",
        "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim",
        "truncate": "truncate",
    }
    if kind != "default":
        for hf_name, ours in names.items():
            if merged.get(hf_name) is not None:
                fields[ours] = merged[hf_name]
        if kind == "llama3" and "original_max_position" not in fields:
            raise ConfigError(f"{arch}: llama3 rope_scaling lacks original_max_position_embeddings")
        if kind == "yarn" and "original_max_position" not in fields:
            fields["original_max_position"] = require_field(
                hf_config, "max_position_embeddings", arch, int
            )
        if kind == "yarn" and merged.get("factor") is None:
            fields["factor"] = (
                require_field(hf_config, "max_position_embeddings", arch, int)
                / fields["original_max_position"]
            )
    try:
        return RopeConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(arch, exc, "rope_scaling.")) from exc


def parse_quantization(hf_config: Mapping[str, Any], arch: str) -> QuantizationConfig | None:
    """Read `quantization_config`; only FP8 (per-channel or per-tensor scales) is supported."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") or q.get("quant_type")
    if method not in ("fp8", "compressed-tensors-fp8"):
        raise ConfigError(
            f"{arch}: quantization_config.quant_method={method!r} is not supported "
            "(FlashRec loads 'fp8' checkpoints; re-export or drop quantization_config)"
        )
    if q.get("weight_block_size"):
        raise ConfigError(
            f"{arch}: quantization_config.weight_block_size={q['weight_block_size']} "
            "(block-wise FP8) is not supported; use per-channel or per-tensor scales"
        )
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"{arch}: quantization_config.activation_scheme={scheme!r} is not supported "
            "(FlashRec quantizes activations per token at run time: 'dynamic')"
        )
    ignored = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    if any(m not in ("lm_head", "output_head") for m in ignored):
        raise ConfigError(
            f"{arch}: quantization_config.modules_to_not_convert={list(ignored)} is not supported "
            "(FlashRec quantizes every Linear of an FP8 checkpoint; only lm_head may be excluded)"
        )
    return QuantizationConfig(method="fp8", ignored_modules=ignored)


def parse_dtype(hf_config: Mapping[str, Any], arch: str = "model") -> str:
    """The checkpoint's declared dtype ("auto" or absent -> bfloat16, the common export)."""
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    if dtype == "auto":
        return "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"{arch}: config.json field 'torch_dtype' is {dtype!r}; expected float32, "
            "bfloat16 or float16"
        )
    return dtype
