"""Qwen3 decoder for FlashRec, top to bottom: Attention, MLP, DecoderLayer, Model, ForCausalLM."""

from __future__ import annotations

import torch
from torch import nn

from flashrec_core.layers import (
    Attention,
    BuildContext,
    Embedding,
    ForwardBatch,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    split_qkv,
)
from flashrec_models_qwen3.spec import Qwen3Config


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_id: int, ctx: BuildContext) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads = config.num_q_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = (
            config.num_q_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.qkv_proj = Linear(
            config.hidden_size, (q_size, kv_size, kv_size), bias=config.attention_bias, ctx=ctx
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias, ctx=ctx)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, ctx) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, ctx) if config.qk_norm else None
        scale = config.head_dim**-0.5
        self.attn = Attention(
            config.num_q_heads, config.num_kv_heads, config.head_dim, layer_id, scale
        )

    def forward(self, x, rotary: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = split_qkv(qkv, self.num_q_heads, self.num_kv_heads, self.head_dim)
        q, k, stored = rotary(q, k, v, batch, self.layer_id, self.q_norm, self.k_norm)
        out = self.attn.forward(q, k, v, self.layer_id, batch, skip_store=stored)
        return self.o_proj(out)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config, ctx: BuildContext) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, (inter, inter), bias=False, ctx=ctx)
        self.act = SiluAndMul(
            quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("silu_mul_fp8")
        )
        self.down_proj = Linear(inter, config.hidden_size, bias=False, ctx=ctx)

    def forward(self, x) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_id: int, ctx: BuildContext) -> None:
        super().__init__()
        norm_args = dict(quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("rms_norm_fp8"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, ctx, **norm_args)
        self.self_attn = Qwen3Attention(config, layer_id, ctx)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.norm_eps, ctx, **norm_args
        )
        self.mlp = Qwen3MLP(config, ctx)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(x, rotary, batch)
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, ctx: BuildContext) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, ctx) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, ctx)
        fused = ctx.kernel("qk_norm_rope_kv") if config.qk_norm else None
        self.rotary_emb = RotaryEmbedding(config.rope, config.max_position, ctx, fused_kernel=fused)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside."""

    def __init__(self, config: Qwen3Config, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, ctx)
        self.output_head = (
            None
            if config.tie_word_embeddings
            else Embedding(config.vocab_size, config.hidden_size, ctx)
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def lm_head(self) -> torch.Tensor:
        """[V, H], the same storage on every call; the embedding itself when tied."""
        head = self.output_head if self.output_head is not None else self.model.embed_tokens
        return head.weight
