"""Phi decoder for FlashRec, top to bottom: Attention, MLP, DecoderLayer, Model, ForCausalLM.

Phi's block is parallel: one LayerNorm feeds attention and the MLP, out = x + attn(ln(x)) +
mlp(ln(x)). In two-stream form a layer returns (attn + mlp, x) and the next LayerNorm adds the
two, so the residual add runs inside the fused LayerNorm->FP8 kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from flashrec_core.layers import (
    Attention,
    BuildContext,
    Embedding,
    ForwardBatch,
    GeluTanh,
    LayerNorm,
    Linear,
    RotaryEmbedding,
    split_qkv,
)
from flashrec_models_phi.spec import PhiConfig


class PhiAttention(nn.Module):
    def __init__(self, config: PhiConfig, layer_id: int, ctx: BuildContext) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads = config.num_q_heads, config.num_kv_heads
        self.head_dim = head_dim = config.head_dim
        q_size, kv_size = self.num_q_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, (q_size, kv_size, kv_size), bias=True, ctx=ctx)
        self.dense = Linear(q_size, config.hidden_size, bias=True, ctx=ctx)
        scale = head_dim**-0.5
        self.attn = Attention(self.num_q_heads, self.num_kv_heads, head_dim, layer_id, scale)

    def forward(self, x, rotary: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = split_qkv(qkv, self.num_q_heads, self.num_kv_heads, self.head_dim)
        q, k, stored = rotary(q, k, v, batch, self.layer_id)  # rotates the first rotary_dim dims
        out = self.attn.forward(q, k, v, self.layer_id, batch, skip_store=stored)
        return self.dense(out)


class PhiMLP(nn.Module):
    def __init__(self, config: PhiConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True, ctx=ctx)
        self.act = GeluTanh(
            quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("gelu_tanh_fp8")
        )
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True, ctx=ctx)

    def forward(self, x) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config: PhiConfig, layer_id: int, ctx: BuildContext) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(
            config.hidden_size, config.norm_eps, ctx,
            quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("layernorm_fp8"),
        )  # fmt: skip
        self.self_attn = PhiAttention(config, layer_id, ctx)
        self.mlp = PhiMLP(config, ctx)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x is one FP8 activation (or one tensor) read by both qkv_proj and fc1.
        x, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(x, rotary, batch) + self.mlp(x), residual


class PhiModel(nn.Module):
    def __init__(self, config: PhiConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(
            PhiDecoderLayer(config, i, ctx) for i in range(config.num_layers)
        )
        self.final_layernorm = LayerNorm(config.hidden_size, config.norm_eps, ctx)
        self.rotary_emb = RotaryEmbedding(
            config.rope, config.max_position, ctx, fused_kernel=ctx.kernel("rope_kv")
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, batch)
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class PhiOutputHead(nn.Module):
    """The LM head's bias [V] and, unless tied to the embedding, its weight [V, H]."""

    def __init__(self, config: PhiConfig, ctx: BuildContext) -> None:
        super().__init__()
        vocab, hidden = config.vocab_size, config.hidden_size
        if not config.tie_word_embeddings:
            weight = torch.empty(vocab, hidden, dtype=ctx.dtype, device=ctx.device)
            self.weight = nn.Parameter(weight, False)
        self.bias = nn.Parameter(torch.empty(vocab, dtype=ctx.dtype, device=ctx.device), False)


class PhiForCausalLM(nn.Module):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside."""

    def __init__(self, config: PhiConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.model = PhiModel(config, ctx)
        self.output_head = PhiOutputHead(config, ctx)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def lm_head(self) -> torch.Tensor:
        """[V, H], the same storage on every call; the embedding itself when tied."""
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.output_head
        return head.weight

    def lm_head_bias(self) -> torch.Tensor:
        """[V]: Phi's head has a bias, also when its weight is tied to the embedding."""
        return self.output_head.bias
