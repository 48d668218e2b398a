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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    import torch


CONTRACT_VERSION = 2
"""The model contract this core speaks. v2 adds, all optional: per-layer `AttentionSpec`s
(`ModelConfig.attention`), `ModelConfig.final_logit_softcap`, and per-module weight hooks
(`WeightHook`); a v1 plugin never sets them and loads unchanged."""
SUPPORTED_CONTRACTS = (1, 2)
"""Contract versions a plugin may declare; the registry refuses any other, naming these."""


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


class AttentionSpec(BaseModel):
    """How one layer attends (contract v2); every attention backend honours every field.

    `logit_softcap` c turns scores s (already scaled) into c * tanh(s / c) before the softmax.
    `sliding_window` W lets a query at position p see keys at positions p - W + 1 .. p (W tokens,
    its own included: transformers' convention), None = the whole context.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    scale: float = Field(gt=0)
    logit_softcap: float | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(default=None, ge=1)


class ModelConfig(BaseModel):
    """Fields every model has, in FlashRec's names. Plugins subclass it with structural flags.

    The engine reads only these fields (KV pool, attention shapes, LM head); everything else a
    family needs lives in the plugin's subclass. Frozen: nothing mutates a config after parsing.
    Strict: a JSON string such as "64" is not an int (transformers would not accept it either).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

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
    """The stored dtype config.json declares; validated (parse_dtype), not read by the engine,
    which takes each tensor's dtype from the safetensors header. Kept for v1 plugins."""
    quantization: QuantizationConfig | None = None
    attention: tuple[AttentionSpec, ...] = ()
    """Per-layer attention specs (contract v2), one per layer; empty = every layer attends over
    the whole context with scale head_dim**-0.5 and no soft-cap (v1)."""
    final_logit_softcap: float | None = Field(default=None, gt=0)
    """c: the restricted LM head turns logits z into c * tanh(z / c) before normalizing (v2)."""

    def attention_spec(self, layer_id: int) -> AttentionSpec:
        """The attention spec of one layer (the v1 default when `attention` is empty)."""
        if self.attention:
            return self.attention[layer_id]
        return AttentionSpec(scale=self.head_dim**-0.5)

    def layer_attention(self) -> tuple[AttentionSpec, ...]:
        return tuple(self.attention_spec(i) for i in range(self.num_layers))

    def max_sliding_window(self) -> int | None:
        windows = [s.sliding_window for s in self.attention if s.sliding_window is not None]
        return max(windows) if windows else None

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        sizes = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
        }  # fmt: skip
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: every size must be >= 1; fix config.json")
        if self.attention and len(self.attention) != self.num_layers:
            raise ValueError(
                f"{len(self.attention)} attention specs for num_hidden_layers={self.num_layers}; "
                "give one per layer (a parser bug, or layer_types of the wrong length)"
            )
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_q_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads} (grouped-query attention shares each "
                "KV head among a whole number of query heads); fix config.json"
            )
        return self


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


@runtime_checkable
class WeightHook(Protocol):
    """A module that loads its own checkpoint tensors (contract v2): for layouts that are not a
    concatenation along the output dim, e.g. per-expert tensors stacked into one [E, out, in]
    parameter, transposed or split tensors. Names are relative to the module (after the weight
    map's renames); the loader routes every checkpoint tensor under the module here and checks
    that exactly `checkpoint_tensors()` arrived, each once."""

    def checkpoint_tensors(self) -> Sequence[str]:
        """Every checkpoint tensor name (relative to this module) the hook expects."""
        ...

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into this module's parameters (raise ValueError on a
        shape it cannot take; the loader names the file and tensor)."""
        ...


FUSED_REQUIREMENTS = ("triton", "fp8_linear", "fp8_kv")
"""The static preconditions a `FusedPath` may require (checked once at build time)."""


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

    def __post_init__(self) -> None:
        unknown = [r for r in self.requires if r not in FUSED_REQUIREMENTS]
        if unknown:
            raise ValueError(
                f"fused path '{self.name}': unknown requirement(s) {unknown}; valid: "
                f"{', '.join(FUSED_REQUIREMENTS)}"
            )
        if not self.switch.startswith("enable_fused_"):
            raise ValueError(
                f"fused path '{self.name}': switch {self.switch!r} must start with enable_fused_"
            )

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
    hf_config_class: str = ""
    """Unused (v1 plugins pass it; the suite's oracle is `model_type` through AutoConfig)."""
    capabilities: tuple[FusedPath, ...] = ()
    examples: tuple[ExampleConfig, ...] = ()
    contract_version: int = CONTRACT_VERSION
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def parse_config(self, hf_config: Mapping[str, Any]) -> ModelConfig:
        from flashrec_core.hf_config import check_common_fields

        archs = hf_config.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else self.architectures[0]
        check_common_fields(hf_config, arch)
        try:
            return self.config_parser(hf_config)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(self.name, exc)) from exc

    def load_model_class(self) -> type[torch.nn.Module]:
        module, _, attr = self.model_class.partition(":")
        return getattr(importlib.import_module(module), attr)

    def capability(self, name: str) -> FusedPath | None:
        return next((c for c in self.capabilities if c.name == name), None)


HF_NAMES = {
    "num_q_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_layers": "num_hidden_layers",
    "max_position": "max_position_embeddings",
}
"""FlashRec field -> the config.json key it is read from, where the names differ (messages)."""


def describe_validation_error(spec_name: str, exc: ValidationError, prefix: str = "") -> str:
    """One line naming every bad field (and its config.json key) with the value found."""
    parts = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            parts.append(msg)
            continue
        loc = prefix + ".".join(str(p) for p in err["loc"])
        hf = HF_NAMES.get(loc)
        name = f"field '{loc}'" + (f" (config.json '{hf}')" if hf else "")
        parts.append(f"{name}: {msg} (got {err.get('input')!r})")
    return f"{spec_name}: invalid config.json: " + "; ".join(parts)
