"""Qwen3 decoder for FlashRec: the shared pre-norm blocks with per-head q/k RMSNorm, fused with
RoPE and the K/V store (`qk_norm_rope_kv`) when the path is on."""

from __future__ import annotations

from flashrec_core.layers import (
    BuildContext,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    SelfAttention,
)
from flashrec_models_qwen3.spec import Qwen3Config


def _layer(config: Qwen3Config, layer_id: int, ctx: BuildContext) -> PreNormDecoderLayer:
    bias = config.attention_bias
    attn = SelfAttention(config, layer_id, ctx, qkv_bias=bias, o_bias=bias, qk_norm=config.qk_norm)
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, ctx)
    return PreNormDecoderLayer(config, attn, mlp, ctx)


class Qwen3ForCausalLM(CausalLM):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside."""

    def __init__(self, config: Qwen3Config, ctx: BuildContext) -> None:
        rope_kernel = ctx.kernel("qk_norm_rope_kv") if config.qk_norm else None
        model = DecoderModel(config, ctx, lambda i: _layer(config, i, ctx), rope_kernel=rope_kernel)
        super().__init__(config, ctx, model)
