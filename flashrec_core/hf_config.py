"""Reading Hugging Face config.json fields into FlashRec's config types, with errors that name
the config.json key. Plugins' `parse_config` functions are built from these helpers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from flashrec_core.spec import (
    ConfigError,
    QuantizationConfig,
    RopeConfig,
    describe_validation_error,
)

COMMON_FIELD_TYPES: dict[str, type] = {
    "vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "max_position_embeddings": int, "rms_norm_eps": float, "layer_norm_eps": float,
    "rope_theta": float, "tie_word_embeddings": bool,
}  # fmt: skip
"""Standard transformers config.json keys and their JSON types, checked for every family before
its parser runs (a parser's `int(...)` would otherwise accept "64", which transformers rejects)."""


def check_common_fields(hf_config: Mapping[str, Any], arch: str) -> None:
    """Type-check the standard keys that are present (null means "use the default")."""
    for key, kind in COMMON_FIELD_TYPES.items():
        if hf_config.get(key) is not None:
            as_type(hf_config[key], kind, key, arch)


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
            f"{arch}: config.json field '{key}' must be {kind.__name__}, got {value!r}; "
            f"write it as a JSON {_JSON_NAMES.get(kind, kind.__name__)}"
        )
    return kind(value)


_JSON_NAMES = {int: "integer (no quotes)", float: "number (no quotes)", bool: "true or false"}


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
        raise ConfigError(describe_validation_error(arch, exc, "rope_scaling.")) from exc


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
