"""Llama and Qwen2 run the shared conformance suite on their tiny example configs, plus the
config fields each family rejects."""

import pytest

from flashrec_core.spec import ConfigError
from flashrec_core.testing import ModelConformance
from flashrec_models_llama import llama_spec, qwen2_spec


class TestLlama(ModelConformance):
    spec = llama_spec


class TestQwen2(ModelConformance):
    spec = qwen2_spec


def _example(spec, **overrides):
    return dict(spec.examples[0].hf_config) | overrides


@pytest.mark.parametrize(
    ("spec", "overrides", "field"),
    [
        (qwen2_spec, {"use_sliding_window": True}, "use_sliding_window"),
        (qwen2_spec, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (qwen2_spec, {"num_key_value_heads": None}, "num_key_value_heads"),
        (llama_spec, {"hidden_act": "gelu"}, "hidden_act"),
        (qwen2_spec, {"hidden_act": "gelu"}, "hidden_act"),
        (llama_spec, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (llama_spec, {"rms_norm_eps": None}, "rms_norm_eps"),
    ],
)
def test_unsupported_or_missing_field_is_named(spec, overrides, field) -> None:
    with pytest.raises(ConfigError, match=field):
        spec.parse_config(_example(spec, **overrides))


def test_bias_flags_follow_each_family() -> None:
    qwen2 = qwen2_spec.parse_config(_example(qwen2_spec))
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.mlp_bias) == (True, False, False)
    llama = llama_spec.parse_config(_example(llama_spec))
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias) == (False, False, False)
    biased = llama_spec.parse_config(_example(llama_spec, attention_bias=True, mlp_bias=True))
    assert (biased.qkv_bias, biased.o_proj_bias, biased.mlp_bias) == (True, True, True)


def test_llama_without_num_key_value_heads_is_multi_head() -> None:
    hf = _example(llama_spec)
    del hf["num_key_value_heads"]
    assert llama_spec.parse_config(hf).num_kv_heads == hf["num_attention_heads"]
