"""Qwen3's spec: architecture name, config parsing, weight buckets and fused capabilities."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashrec_core.fused import QK_NORM_ROPE_KV, RMS_NORM_FP8, SILU_MUL_FP8
from flashrec_core.hf_config import (
    optional_field,
    parse_dtype,
    parse_quantization,
    parse_rope,
    require_field,
)
from flashrec_core.spec import BaseModelSpec, Bucket, ExampleConfig, ModelConfig, WeightMap

ARCH = "Qwen3ForCausalLM"


class Qwen3Config(ModelConfig):
    """Qwen3 structure: q/k RMSNorm per head, optional attention bias, SwiGLU MLP."""

    qk_norm: bool = True
    attention_bias: bool = False


HF_HEAD_DIM_DEFAULT = 128  # transformers' Qwen3Config default when config.json omits head_dim


def parse_qwen3_config(hf: Mapping[str, Any]) -> Qwen3Config:
    def get(key: str, kind: type = int) -> Any:
        return require_field(hf, key, ARCH, kind)

    head_dim = optional_field(hf, "head_dim", ARCH, int, HF_HEAD_DIM_DEFAULT)
    return Qwen3Config(
        architecture=ARCH,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"),
        num_q_heads=get("num_attention_heads"),
        num_kv_heads=get("num_key_value_heads"),
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        max_position=get("max_position_embeddings"),
        tie_word_embeddings=optional_field(hf, "tie_word_embeddings", ARCH, bool, False),
        rope=parse_rope(hf, head_dim, ARCH),
        norm_eps=get("rms_norm_eps", float),
        checkpoint_dtype=parse_dtype(hf, ARCH),
        quantization=parse_quantization(hf, ARCH),
        attention_bias=optional_field(hf, "attention_bias", ARCH, bool, False),
    )


def _tiny(**overrides: Any) -> dict[str, Any]:
    base = {
        "architectures": [ARCH],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return base | overrides


BENCH_PRESETS = {
    # Qwen3-1.7B's shape with a 3 x 8192 SID vocabulary and two boundary tokens appended.
    "qwen3-1.7b": _tiny(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        vocab_size=151643 + 3 * 8192 + 2,
    ),
    "qwen3-small": _tiny(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        vocab_size=1000 + 3 * 256 + 2,
    ),
}

spec = BaseModelSpec(
    name="qwen3",
    architectures=(ARCH,),
    config_parser=parse_qwen3_config,
    weight_map=WeightMap(
        buckets=(
            Bucket(
                "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            ),
            Bucket("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        renames=(("lm_head.", "output_head."),),
        ignore=(r".*rotary_emb\.inv_freq",),
        tied=(("output_head.weight", "model.embed_tokens.weight"),),
    ),
    capabilities=(RMS_NORM_FP8, SILU_MUL_FP8, QK_NORM_ROPE_KV),
    model_class="flashrec_models_qwen3.modeling:Qwen3ForCausalLM",
    hf_config_class="transformers:Qwen3Config",
    # recipe_default: `flashrec recipe build` trains this architecture unless --arch says otherwise
    metadata={"bench_presets": BENCH_PRESETS, "recipe_default": True},
    examples=(
        ExampleConfig("tied-gqa", _tiny()),
        ExampleConfig("untied-mha", _tiny(tie_word_embeddings=False, num_key_value_heads=4)),
        ExampleConfig(
            "yarn-bias",
            _tiny(
                attention_bias=True,
                rope_scaling={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                },
            ),
        ),  # fmt: skip
    ),
)
