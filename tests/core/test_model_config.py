"""config.json -> ModelConfig through the Qwen3 spec: every bad field fails with its name."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

import flashrec_models_qwen3
from flashrec_core.spec import ConfigError, RopeConfig

SPEC = flashrec_models_qwen3.spec
BASE = dict(SPEC.examples[0].hf_config)  # hidden 64, 4 q heads, 2 kv heads, head_dim 16


def _hf(**changes: Any) -> dict[str, Any]:
    """The base config with changes applied; a value of `...` deletes the key."""
    hf = {**BASE, **changes}
    return {k: v for k, v in hf.items() if v is not ...}


def _error(hf: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        SPEC.parse_config(hf)
    return str(info.value)


def test_valid_config_fields() -> None:
    c = SPEC.parse_config(BASE)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers) == (
        "Qwen3ForCausalLM",
        512,
        64,
        2,
    )
    assert (c.num_q_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (4, 2, 16, 128)
    assert (c.max_position, c.norm_eps, c.tie_word_embeddings) == (1024, 1e-6, True)
    assert c.rope == RopeConfig(theta=10000.0, rotary_dim=16)
    assert c.quantization is None and c.qk_norm is True and c.attention_bias is False


def test_config_is_frozen() -> None:
    c = SPEC.parse_config(BASE)
    with pytest.raises(ValidationError):
        c.hidden_size = 128  # type: ignore[misc]


@pytest.mark.parametrize(
    "field",
    ["num_key_value_heads", "hidden_size", "num_hidden_layers", "rms_norm_eps", "vocab_size",
     "intermediate_size", "max_position_embeddings", "num_attention_heads"],
)  # fmt: skip
def test_missing_required_field_is_named(field: str) -> None:
    msg = _error(_hf(**{field: ...}))
    assert f"lacks required field '{field}'" in msg and "Qwen3ForCausalLM" in msg


def test_null_required_field_is_named() -> None:
    assert "'num_key_value_heads'" in _error(_hf(num_key_value_heads=None))


def test_missing_rope_theta_is_named() -> None:
    assert "'rope_theta'" in _error(_hf(rope_theta=...))


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type_is_named(key: str) -> None:
    msg = _error(_hf(**{key: {"rope_type": "dynamic", "factor": 2.0}}))
    assert "'dynamic'" in msg and "not supported" in msg


def test_llama3_rope_without_original_max_position() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    assert "original_max_position_embeddings" in _error(_hf(rope_scaling=scaling))


def test_blockwise_fp8_is_rejected() -> None:
    q = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    msg = _error(_hf(quantization_config=q))
    assert "weight_block_size=[128, 128]" in msg and "block-wise" in msg


def test_unsupported_quant_method_is_named() -> None:
    assert "quant_method='awq'" in _error(_hf(quantization_config={"quant_method": "awq"}))


def test_static_activation_scheme_is_rejected() -> None:
    q = {"quant_method": "fp8", "activation_scheme": "static"}
    assert "activation_scheme='static'" in _error(_hf(quantization_config=q))


def test_fp8_quantization_config_is_read() -> None:
    q = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    quant = SPEC.parse_config(_hf(quantization_config=q)).quantization
    assert quant is not None and quant.method == "fp8" and quant.ignored_modules == ("lm_head",)


@pytest.mark.parametrize("field", ["vocab_size", "intermediate_size"])
def test_wrong_type_field_is_named(field: str) -> None:
    msg = _error(_hf(**{field: "abc"}))
    assert f"field '{field}'" in msg and "'abc'" in msg


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "head_dim"])
def test_wrong_type_converted_field_is_named(field: str) -> None:
    msg = _error(_hf(**{field: "abc"}))
    assert f"'{field}'" in msg and "'abc'" in msg


def test_wrong_type_rope_theta_is_named() -> None:
    msg = _error(_hf(rope_theta="abc"))
    assert "'rope_theta'" in msg and "'abc'" in msg


@pytest.mark.parametrize(
    "field", ["num_key_value_heads", "rms_norm_eps", "num_hidden_layers", "max_position_embeddings"]
)
def test_wrong_type_renamed_field_names_config_json_key(field: str) -> None:
    msg = _error(_hf(**{field: "abc"}))
    assert f"'{field}'" in msg and "'abc'" in msg


def test_missing_head_dim_is_not_guessed_from_another_family() -> None:
    from transformers import Qwen3Config

    hf = _hf(head_dim=...)
    hf_head_dim = Qwen3Config(**{k: v for k, v in hf.items() if k != "model_type"}).head_dim
    try:
        config = SPEC.parse_config(hf)
    except ConfigError as exc:
        assert "'head_dim'" in str(exc)
        return
    assert config.head_dim == hf_head_dim


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    },
    "yarn": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 256, "beta_fast": 16.0, "attention_factor": 0.9,
    },
}  # fmt: skip


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_parameters_and_legacy_rope_scaling_agree(case: str) -> None:
    params = dict(ROPE_CASES[case])
    new_style = SPEC.parse_config(_hf(rope_theta=..., rope_parameters=dict(params)))
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")  # the oldest spelling
    legacy = _hf(rope_theta=theta, rope_scaling=params if case != "default" else None)
    assert SPEC.parse_config(legacy).rope == new_style.rope
    assert new_style.rope.theta == theta and new_style.rope.scaling_type == case


def test_rope_fields_are_translated() -> None:
    rope = SPEC.parse_config(_hf(rope_theta=..., rope_parameters=dict(ROPE_CASES["llama3"]))).rope
    assert rope == RopeConfig(
        theta=5e5, rotary_dim=16, scaling_type="llama3", factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position=256,
    )  # fmt: skip
    yarn = SPEC.parse_config(_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0})).rope
    assert yarn.original_max_position == 1024  # max_position_embeddings, as transformers does


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_factor_sets_rotary_dim(where: str) -> None:
    if where == "top":
        hf = _hf(partial_rotary_factor=0.5)
    else:
        hf = _hf(rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5})  # fmt: skip
    config = SPEC.parse_config(hf)
    assert config.rope.rotary_dim == 8 and config.head_dim == 16


def test_partial_rotary_factor_giving_odd_dim_is_named() -> None:
    msg = _error(_hf(partial_rotary_factor=0.0625))  # 16 * 0.0625 = 1
    assert "partial_rotary_factor=0.0625" in msg and "rotary dim 1" in msg
