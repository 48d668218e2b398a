"""Llama-structure decoder (Llama, Qwen2): the shared pre-norm blocks without q/k norm, so RoPE
+ KV store is the fused path (`rope_kv`); biases where the family's flags put them."""

from __future__ import annotations

from flashrec_core.layers import (
    BuildContext,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    SelfAttention,
)
from flashrec_models_llama.spec import LlamaConfig


def _layer(config: LlamaConfig, layer_id: int, ctx: BuildContext) -> PreNormDecoderLayer:
    attn = SelfAttention(config, layer_id, ctx, qkv_bias=config.qkv_bias, o_bias=config.o_proj_bias)
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, ctx, bias=config.mlp_bias)
    return PreNormDecoderLayer(config, attn, mlp, ctx)


class LlamaForCausalLM(CausalLM):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside."""

    def __init__(self, config: LlamaConfig, ctx: BuildContext) -> None:
        model = DecoderModel(
            config, ctx, lambda i: _layer(config, i, ctx), rope_kernel=ctx.kernel("rope_kv")
        )
        super().__init__(config, ctx, model)
