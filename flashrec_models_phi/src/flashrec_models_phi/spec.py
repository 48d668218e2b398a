"""Phi's spec: architecture name, config parsing, weight buckets and fused capabilities."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from flashrec_core.fused import ROPE_KV
from flashrec_core.hf_config import parse_dtype, parse_quantization, parse_rope, require_field
from flashrec_core.spec import (
    BaseModelSpec,
    Bucket,
    ConfigError,
    ExampleConfig,
    FusedPath,
    ModelConfig,
    WeightMap,
)

ARCH = "PhiForCausalLM"
GELU_TANH_ACTS = ("gelu_new", "gelu_pytorch_tanh")
"""HF activation names that are GELU with the tanh approximation (same function)."""
PHI_PARTIAL_ROTARY = 0.5
"""transformers' PhiConfig default when config.json gives no partial_rotary_factor."""

LAYERNORM_FP8 = FusedPath(
    name="layernorm_fp8",
    switch="enable_fused_layernorm_fp8",
    kernel="flashrec_models_phi.kernels:layer_norm_quant_fp8",
    description="residual add + LayerNorm (with bias), quantized to FP8 with a per-token scale",
    requires=("triton", "fp8_linear"),
)
GELU_TANH_FP8 = FusedPath(
    name="gelu_tanh_fp8",
    switch="enable_fused_gelu_fp8",
    kernel="flashrec_models_phi.kernels:gelu_tanh_quant_fp8",
    description="GELU (tanh approximation, not gated), quantized to FP8 with a per-token scale",
    requires=("triton", "fp8_linear"),
)


class PhiConfig(ModelConfig):
    """Phi structure: one biased LayerNorm feeds attention and MLP in parallel, a non-gated
    GELU(tanh) MLP, biases on q/k/v/dense/fc1/fc2 and on the LM head, partial rotary
    (`rope.rotary_dim`). Every one of these is fixed for the family; only the activation's HF
    name varies, and both accepted names mean the same function."""

    hidden_act: Literal["gelu_tanh"] = "gelu_tanh"


def parse_phi_config(hf: Mapping[str, Any]) -> PhiConfig:
    def get(key: str) -> Any:
        return require_field(hf, key, ARCH)

    _check_structure(hf)
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(hf.get("head_dim") or _even_split(hidden, heads))
    return PhiConfig(
        architecture=ARCH,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_q_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,  # PhiConfig: null means MHA
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        max_position=get("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope=parse_rope(_with_phi_rotary_default(hf), head_dim, ARCH),
        norm_eps=get("layer_norm_eps"),
        checkpoint_dtype=parse_dtype(hf),
        quantization=parse_quantization(hf, ARCH),
    )


def _check_structure(hf: Mapping[str, Any]) -> None:
    """Reject the Phi variants this plugin does not build, naming the field."""
    if hf.get("qk_layernorm"):
        raise ConfigError(
            f"{ARCH}: config.json sets qk_layernorm=true (a per-head LayerNorm on q and k), which "
            "FlashRec's Phi does not support; it serves checkpoints with qk_layernorm=false "
            "(Phi-1, Phi-1.5, Phi-2)"
        )
    act = hf.get("hidden_act", "gelu_new")  # PhiConfig's default
    if act not in GELU_TANH_ACTS:
        raise ConfigError(
            f"{ARCH}: hidden_act={act!r} is not supported; supported: "
            f"{', '.join(GELU_TANH_ACTS)} (GELU with the tanh approximation)"
        )


def _even_split(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ConfigError(
            f"{ARCH}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "and config.json has no head_dim"
        )
    return hidden // heads


def _with_phi_rotary_default(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """PhiConfig rotates half of each head unless config.json gives partial_rotary_factor."""
    nested = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    if hf.get("partial_rotary_factor") is not None or "partial_rotary_factor" in nested:
        return hf
    return {**hf, "partial_rotary_factor": PHI_PARTIAL_ROTARY}


def _tiny(**overrides: Any) -> dict[str, Any]:
    base = {
        "architectures": [ARCH],
        "model_type": "phi",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
        "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "hidden_act": "gelu_new",
        "qk_layernorm": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return base | overrides


spec = BaseModelSpec(
    name="phi",
    architectures=(ARCH,),
    config_parser=parse_phi_config,
    weight_map=WeightMap(
        buckets=(
            Bucket(
                "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            ),
        ),
        renames=(("lm_head.", "output_head."),),
        ignore=(r".*rotary_emb\.inv_freq",),
        tied=(("output_head.weight", "model.embed_tokens.weight"),),
    ),
    capabilities=(LAYERNORM_FP8, GELU_TANH_FP8, ROPE_KV),
    model_class="flashrec_models_phi.modeling:PhiForCausalLM",
    hf_config_class="transformers:PhiConfig",
    examples=(
        ExampleConfig("untied-mha-half-rotary", _tiny()),
        ExampleConfig(
            "tied-gqa-rotary-0.4",
            _tiny(
                tie_word_embeddings=True,
                num_key_value_heads=2,
                partial_rotary_factor=0.4,
                hidden_act="gelu_pytorch_tanh",
            ),
        ),  # fmt: skip
    ),
)
