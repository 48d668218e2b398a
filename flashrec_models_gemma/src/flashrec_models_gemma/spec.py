"""Specs of Gemma (v1) and Gemma 2: names, config parsing, buckets, capabilities, examples.

Both are Llama-like decoders with Gemma's own choices, each a named field of `GemmaConfig`:
norms stored as `1 + weight`, embeddings scaled by sqrt(hidden_size), a GeGLU MLP (GELU-tanh).
Gemma 2 adds (contract v2) attention-logit soft-capping, a final-logit soft-cap, alternating
sliding-window layers, `query_pre_attn_scalar` as the attention scale, and norms after attention
and around the MLP (`sandwich_norms`). Defaults are transformers' own for each family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashrec_core.fused import GELU_MUL_FP8, RMS_NORM_FP8, ROPE_KV
from flashrec_core.hf_config import (
    optional_field,
    parse_dtype,
    parse_quantization,
    parse_rope,
    require_field,
)
from flashrec_core.spec import (
    CONTRACT_VERSION,
    AttentionSpec,
    BaseModelSpec,
    Bucket,
    ConfigError,
    ExampleConfig,
    ModelConfig,
    WeightMap,
)

GEMMA_ARCH = "GemmaForCausalLM"
GEMMA2_ARCH = "Gemma2ForCausalLM"
MODEL_CLASS = "flashrec_models_gemma.modeling:GemmaForCausalLM"
HF_HEAD_DIM_DEFAULT = 256  # both transformers configs
LAYER_TYPES = ("full_attention", "sliding_attention")


class GemmaConfig(ModelConfig):
    """Gemma structure; Gemma 2's extras are `sandwich_norms` plus the v2 attention specs."""

    sandwich_norms: bool
    """Norms after attention and before/after the MLP (Gemma 2), besides the input norm."""
    attention_bias: bool
    embed_scale: float
    """sqrt(hidden_size): multiplies the embedding output (not the LM head)."""


def _nullable(hf: Mapping[str, Any], key: str, arch: str, default: float | None) -> float | None:
    """A soft-cap: absent -> the family default; an explicit null -> off (as transformers)."""
    if key not in hf:
        return default
    value = hf[key]
    return None if value is None else optional_field(hf, key, arch, float, default)


def _check_activation(hf: Mapping[str, Any], keys: tuple[str, ...], arch: str) -> None:
    """Gemma's MLP is GELU-tanh. Gemma v1 configs say "gelu", which transformers reads as the
    tanh approximation (what the checkpoints were trained with)."""
    key = next((k for k in keys if hf.get(k) is not None), None)
    value = "gelu_pytorch_tanh" if key is None else hf[key]
    if value not in ("gelu_pytorch_tanh", "gelu_new", "gelu" if arch == GEMMA_ARCH else ""):
        raise ConfigError(
            f"{arch}: config.json field '{key}' is {value!r}; the Gemma MLP is GELU-tanh "
            "(gelu_pytorch_tanh); a different activation is not this family"
        )


def _common(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    def get(key: str, kind: type = int) -> Any:
        return require_field(hf, key, arch, kind)

    head_dim = optional_field(hf, "head_dim", arch, int, HF_HEAD_DIM_DEFAULT)
    rope = parse_rope(hf, head_dim, arch)
    if rope.rotary_dim != head_dim:
        raise ConfigError(f"{arch}: partial_rotary_factor is not supported (Gemma rotates all)")
    hidden = get("hidden_size")
    return dict(
        architecture=arch,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_q_heads=get("num_attention_heads"),
        num_kv_heads=get("num_key_value_heads"),
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        max_position=get("max_position_embeddings"),
        tie_word_embeddings=optional_field(hf, "tie_word_embeddings", arch, bool, True),
        rope=rope,
        norm_eps=optional_field(hf, "rms_norm_eps", arch, float, 1e-6),
        checkpoint_dtype=parse_dtype(hf, arch),
        quantization=parse_quantization(hf, arch),
        attention_bias=optional_field(hf, "attention_bias", arch, bool, False),
        embed_scale=hidden**0.5,
    )


def parse_gemma_config(hf: Mapping[str, Any]) -> GemmaConfig:
    _check_activation(hf, ("hidden_act", "hidden_activation"), GEMMA_ARCH)
    return GemmaConfig(**_common(hf, GEMMA_ARCH), sandwich_norms=False)


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """transformers' default: layer i slides when i is even (sliding, full, sliding, ...)."""
    types = hf.get("layer_types")
    if types is None:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ConfigError(
            f"{GEMMA2_ARCH}: config.json field 'layer_types' is {types!r}; expected "
            f"{num_layers} entries of {list(LAYER_TYPES)}"
        )
    return types


def parse_gemma2_config(hf: Mapping[str, Any]) -> GemmaConfig:
    arch = GEMMA2_ARCH
    _check_activation(hf, ("hidden_activation",), arch)
    fields = _common(hf, arch)
    scalar = optional_field(hf, "query_pre_attn_scalar", arch, float, 256.0)
    softcap = _nullable(hf, "attn_logit_softcapping", arch, 50.0)
    window = _nullable(hf, "sliding_window", arch, 4096)
    types = _layer_types(hf, fields["num_layers"])
    if window is None and "sliding_attention" in types:
        raise ConfigError(f"{arch}: layer_types has sliding layers but 'sliding_window' is null")
    specs = tuple(
        AttentionSpec(
            scale=scalar**-0.5,
            logit_softcap=softcap,
            sliding_window=int(window) if t == "sliding_attention" else None,
        )  # fmt: skip
        for t in types
    )
    return GemmaConfig(
        **fields, sandwich_norms=True, attention=specs,
        final_logit_softcap=_nullable(hf, "final_logit_softcapping", arch, 30.0),
    )  # fmt: skip


WEIGHT_MAP = WeightMap(
    buckets=(
        Bucket("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Bucket("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
    renames=(("lm_head.", "output_head."),),
    ignore=(r".*rotary_emb\.inv_freq",),
    tied=(("output_head.weight", "model.embed_tokens.weight"),),
)
CAPABILITIES = (RMS_NORM_FP8, GELU_MUL_FP8, ROPE_KV)


def _tiny(arch: str, model_type: str, **overrides: Any) -> dict[str, Any]:
    """A tiny config.json with only the keys a published checkpoint of the family has."""
    base = {
        "architectures": [arch],
        "model_type": model_type,
        "attention_bias": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": 512,
    }
    return {k: v for k, v in (base | overrides).items() if v is not None}


def _tiny_gemma2(**overrides: Any) -> dict[str, Any]:
    published = {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 24,  # != head_dim 16: the scale must come from here
        "sliding_window": 8,  # shorter than the suite's long prompts
    }
    return _tiny(GEMMA2_ARCH, "gemma2", **(published | overrides))


gemma_spec = BaseModelSpec(
    name="gemma",
    architectures=(GEMMA_ARCH,),
    config_parser=parse_gemma_config,
    weight_map=WEIGHT_MAP,
    capabilities=CAPABILITIES,
    model_class=MODEL_CLASS,
    contract_version=CONTRACT_VERSION,
    examples=(
        # gemma-2b's keys: tie_word_embeddings omitted (default true), the legacy "gelu"
        ExampleConfig("tied-mqa", _tiny(GEMMA_ARCH, "gemma", hidden_act="gelu")),
        ExampleConfig(
            "untied-gqa",
            _tiny(
                GEMMA_ARCH,
                "gemma",
                hidden_act="gelu_pytorch_tanh",
                num_key_value_heads=2,
                tie_word_embeddings=False,
            ),
        ),  # fmt: skip
    ),
)

gemma2_spec = BaseModelSpec(
    name="gemma2",
    architectures=(GEMMA2_ARCH,),
    config_parser=parse_gemma2_config,
    weight_map=WEIGHT_MAP,
    capabilities=CAPABILITIES,
    model_class=MODEL_CLASS,
    contract_version=CONTRACT_VERSION,
    examples=(
        # gemma-2-2b's keys (no layer_types: the alternating default), real soft-caps
        ExampleConfig("tied-published", _tiny_gemma2()),
        # caps small enough to bend most scores and logits, explicit layer_types, untied head
        ExampleConfig(
            "untied-tight-caps",
            _tiny_gemma2(
                attn_logit_softcapping=1.5,
                final_logit_softcapping=2.0,
                sliding_window=6,
                layer_types=["full_attention", "sliding_attention"],
                tie_word_embeddings=False,
            ),
        ),  # fmt: skip
    ),
)
