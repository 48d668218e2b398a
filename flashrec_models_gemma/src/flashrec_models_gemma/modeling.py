"""Gemma and Gemma 2 for FlashRec: the shared blocks with Gemma's norms (stored as 1 + weight),
scaled embeddings and GeGLU MLP; Gemma 2's sandwich norms around attention and MLP. Soft-caps
and sliding windows are the v2 attention specs in the config, applied by every backend."""

from __future__ import annotations

import torch
from torch import nn

from flashrec_core.layers import (
    BuildContext,
    CausalLM,
    DecoderModel,
    ForwardBatch,
    GatedMLP,
    PreNormDecoderLayer,
    RotaryEmbedding,
    SelfAttention,
    block_norm,
)
from flashrec_models_gemma.spec import GemmaConfig

NORM_OFFSET = 1.0  # Gemma's norms multiply by (1 + weight)


class Gemma2DecoderLayer(nn.Module):
    """x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.))), two-stream residual."""

    def __init__(
        self, config: GemmaConfig, self_attn: SelfAttention, mlp: GatedMLP, ctx: BuildContext
    ) -> None:
        super().__init__()
        self.input_layernorm = block_norm(config, ctx, weight_offset=NORM_OFFSET)
        self.self_attn = self_attn
        # their outputs join the residual stream, not a GEMM: never FP8
        self.post_attention_layernorm = block_norm(
            config, ctx, weight_offset=NORM_OFFSET, quantize=False
        )
        self.pre_feedforward_layernorm = block_norm(config, ctx, weight_offset=NORM_OFFSET)
        self.mlp = mlp
        self.post_feedforward_layernorm = block_norm(
            config, ctx, weight_offset=NORM_OFFSET, quantize=False
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(hidden, residual)
        hidden, _ = self.post_attention_layernorm(self.self_attn(x, rotary, batch))
        x, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(x))
        return hidden, residual


def _layer(config: GemmaConfig, layer_id: int, ctx: BuildContext) -> nn.Module:
    bias = config.attention_bias
    attn = SelfAttention(config, layer_id, ctx, qkv_bias=bias, o_bias=bias)
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, ctx, act="gelu_tanh")
    if config.sandwich_norms:
        return Gemma2DecoderLayer(config, attn, mlp, ctx)
    return PreNormDecoderLayer(config, attn, mlp, ctx, norm_offset=NORM_OFFSET)


class GemmaForCausalLM(CausalLM):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside and
    applies `config.final_logit_softcap`."""

    def __init__(self, config: GemmaConfig, ctx: BuildContext) -> None:
        model = DecoderModel(
            config, ctx, lambda i: _layer(config, i, ctx), rope_kernel=ctx.kernel("rope_kv"),
            embed_scale=config.embed_scale, norm_offset=NORM_OFFSET,
        )  # fmt: skip
        super().__init__(config, ctx, model)
