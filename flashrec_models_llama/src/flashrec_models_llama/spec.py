"""Specs of the Llama-structure families (Llama, Qwen2): names, config parsing, buckets, capabilities.

Both families are the same decoder: RMSNorm, RoPE without q/k norm, GQA, SwiGLU MLP. They differ
only in where biases sit, which each parser states as named flags of one `LlamaConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashrec_core.fused import RMS_NORM_FP8, ROPE_KV, SILU_MUL_FP8
from flashrec_core.hf_config import parse_dtype, parse_quantization, parse_rope, require_field
from flashrec_core.spec import (
    BaseModelSpec,
    Bucket,
    ConfigError,
    ExampleConfig,
    ModelConfig,
    WeightMap,
)

LLAMA_ARCH = "LlamaForCausalLM"
QWEN2_ARCH = "Qwen2ForCausalLM"
MODEL_CLASS = "flashrec_models_llama.modeling:LlamaForCausalLM"


class LlamaConfig(ModelConfig):
    """Llama structure: no q/k norm, SwiGLU MLP; biases as the family places them."""

    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2 always; Llama with `attention_bias`)."""
    o_proj_bias: bool
    """The attention output projection carries a bias (Llama with `attention_bias`)."""
    mlp_bias: bool
    """gate/up/down projections carry a bias (Llama with `mlp_bias`)."""


def _common_fields(hf: Mapping[str, Any], arch: str, num_kv_heads: int) -> dict[str, Any]:
    """The ModelConfig fields both families read the same way."""

    def get(key: str) -> Any:
        return require_field(hf, key, arch)

    act = hf.get("hidden_act", "silu")  # both families' HF default
    if act != "silu":
        raise ConfigError(f"{arch}: hidden_act={act!r} is not supported (the MLP is SiLU-gated)")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    rope = parse_rope(hf, head_dim, arch)
    if rope.rotary_dim != head_dim:
        raise ConfigError(
            f"{arch}: partial_rotary_factor gives rotary dim {rope.rotary_dim} < head_dim "
            f"{head_dim}; this family rotates the whole head (drop partial_rotary_factor)"
        )
    return dict(
        architecture=arch,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_q_heads=heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        max_position=get("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope=rope,
        norm_eps=get("rms_norm_eps"),
        checkpoint_dtype=parse_dtype(hf),
        quantization=parse_quantization(hf, arch),
    )


def parse_llama_config(hf: Mapping[str, Any]) -> LlamaConfig:
    heads = require_field(hf, "num_attention_heads", LLAMA_ARCH)
    # Llama-1/2 configs omit num_key_value_heads: multi-head attention (Llama's own default).
    num_kv_heads = int(hf.get("num_key_value_heads") or heads)
    # pretraining_tp > 1 only split the GEMMs during pretraining; the math is the same, so it is
    # not read (transformers 5 ignores it too).
    attention_bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **_common_fields(hf, LLAMA_ARCH, num_kv_heads),
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def parse_qwen2_config(hf: Mapping[str, Any]) -> LlamaConfig:
    if hf.get("use_sliding_window"):
        raise ConfigError(
            f"{QWEN2_ARCH}: use_sliding_window=true is not supported (FlashRec attends over the "
            "full context); set it to false if the checkpoint was trained with full attention"
        )
    layer_types = set(hf.get("layer_types") or ()) - {"full_attention"}
    if layer_types:
        raise ConfigError(
            f"{QWEN2_ARCH}: layer_types contains {sorted(layer_types)}; only 'full_attention' "
            "layers are supported"
        )
    num_kv_heads = int(require_field(hf, "num_key_value_heads", QWEN2_ARCH))
    return LlamaConfig(
        **_common_fields(hf, QWEN2_ARCH, num_kv_heads),
        qkv_bias=True,
        o_proj_bias=False,
        mlp_bias=False,
    )


WEIGHT_MAP = WeightMap(
    buckets=(
        Bucket("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Bucket("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
    renames=(("lm_head.", "output_head."),),
    ignore=(r".*rotary_emb\.inv_freq",),
    tied=(("output_head.weight", "model.embed_tokens.weight"),),
)
CAPABILITIES = (RMS_NORM_FP8, SILU_MUL_FP8, ROPE_KV)


def _tiny(arch: str, model_type: str, **overrides: Any) -> dict[str, Any]:
    base = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return {k: v for k, v in (base | overrides).items() if v is not None}


def _tiny_llama(**overrides: Any) -> dict[str, Any]:
    return _tiny(LLAMA_ARCH, "llama", **overrides)


def _tiny_qwen2(**overrides: Any) -> dict[str, Any]:
    # the sliding-window fields as real Qwen2 checkpoints ship them (window off)
    window = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
    return _tiny(QWEN2_ARCH, "qwen2", **(window | overrides))


llama_spec = BaseModelSpec(
    name="llama",
    architectures=(LLAMA_ARCH,),
    config_parser=parse_llama_config,
    weight_map=WEIGHT_MAP,
    capabilities=CAPABILITIES,
    model_class=MODEL_CLASS,
    hf_config_class="transformers:LlamaConfig",
    examples=(
        ExampleConfig("tied-gqa", _tiny_llama()),
        # num_key_value_heads omitted: Llama-2 style multi-head attention
        ExampleConfig(
            "untied-mha", _tiny_llama(tie_word_embeddings=False, num_key_value_heads=None)
        ),
        ExampleConfig(
            "llama3-rope-bias",
            _tiny_llama(
                tie_word_embeddings=False,
                head_dim=32,
                attention_bias=True,
                mlp_bias=True,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
    ),
)

qwen2_spec = BaseModelSpec(
    name="qwen2",
    architectures=(QWEN2_ARCH,),
    config_parser=parse_qwen2_config,
    weight_map=WEIGHT_MAP,
    capabilities=CAPABILITIES,
    model_class=MODEL_CLASS,
    hf_config_class="transformers:Qwen2Config",
    examples=(
        ExampleConfig("tied-gqa", _tiny_qwen2()),
        ExampleConfig("untied-mha", _tiny_qwen2(tie_word_embeddings=False, num_key_value_heads=4)),
    ),
)
