"""Decoder blocks several families share: self-attention, the gated MLP, the pre-norm layer, the
decoder stack and the causal-LM shell. A family's model file composes them and keeps only what
differs (its flags, its norms, its layer order).

Attribute names mirror the usual checkpoint keys (`self_attn.qkv_proj`, `mlp.gate_up_proj`,
`input_layernorm`, `model.embed_tokens`, ...), so weight maps list only the buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from flashrec_core.layers.activation import GeluAndMul, SiluAndMul
from flashrec_core.layers.attention import Attention, split_qkv
from flashrec_core.layers.batch import ForwardBatch
from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.embedding import Embedding
from flashrec_core.layers.linear import Linear
from flashrec_core.layers.norm import RMSNorm
from flashrec_core.layers.rotary import RotaryEmbedding
from flashrec_core.spec import ModelConfig

Activation = Literal["silu", "gelu_tanh"]


class SelfAttention(nn.Module):
    """Fused qkv GEMM, optional per-head q/k RMSNorm, RoPE (+ fused K/V store), paged attention
    with the layer's `AttentionSpec`, output GEMM. Shapes come from the config only."""

    def __init__(
        self, config: ModelConfig, layer_id: int, ctx: BuildContext, *, qkv_bias: bool = False,
        o_bias: bool = False, qk_norm: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layer_id = layer_id
        self.shape = (config.num_q_heads, config.num_kv_heads, config.head_dim)
        q_size, kv_size = (
            config.num_q_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.qkv_proj = Linear(
            config.hidden_size, (q_size, kv_size, kv_size), bias=qkv_bias, ctx=ctx
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias, ctx=ctx)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, ctx) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, ctx) if qk_norm else None
        self.attn = Attention(*self.shape, layer_id, config.attention_spec(layer_id))

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), *self.shape)
        q, k, stored = rotary(q, k, v, batch, self.layer_id, self.q_norm, self.k_norm)
        return self.o_proj(self.attn.forward(q, k, v, self.layer_id, batch, skip_store=stored))


class GatedMLP(nn.Module):
    """gate_up GEMM -> act(gate) * up (FP8 out when the next GEMM is FP8) -> down GEMM."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, ctx: BuildContext, *,
        bias: bool = False, act: Activation = "silu",
    ) -> None:  # fmt: skip
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = Linear(hidden_size, (inter, inter), bias=bias, ctx=ctx)
        if act == "silu":
            self.act: nn.Module = SiluAndMul(
                quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("silu_mul_fp8")
            )
        elif act == "gelu_tanh":
            self.act = GeluAndMul(
                quantize_output=ctx.fp8_linear, fused_kernel=ctx.kernel("gelu_mul_fp8")
            )
        else:
            raise ValueError(f"unknown gated activation {act!r}; choose 'silu' or 'gelu_tanh'")
        self.down_proj = Linear(inter, hidden_size, bias=bias, ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def block_norm(
    config: ModelConfig, ctx: BuildContext, *, weight_offset: float = 0.0, quantize: bool = True
) -> RMSNorm:
    """A hidden-size RMSNorm that feeds a GEMM: FP8 output (fused when the path is on)."""
    quantize = quantize and ctx.fp8_linear
    return RMSNorm(
        config.hidden_size, config.norm_eps, ctx, quantize_output=quantize,
        fused_kernel=ctx.kernel("rms_norm_fp8") if quantize else None, weight_offset=weight_offset,
    )  # fmt: skip


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), on the two-stream residual."""

    def __init__(
        self, config: ModelConfig, self_attn: SelfAttention, mlp: GatedMLP, ctx: BuildContext,
        *, norm_offset: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = block_norm(config, ctx, weight_offset=norm_offset)
        self.self_attn = self_attn
        self.post_attention_layernorm = block_norm(config, ctx, weight_offset=norm_offset)
        self.mlp = mlp

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


class DecoderModel(nn.Module):
    """Embedding (optionally scaled), the layers `make_layer(i)` builds, the final norm and the
    rotary cache shared by every layer (`rope_kernel`: its fused RoPE + KV store, or None)."""

    def __init__(
        self, config: ModelConfig, ctx: BuildContext, make_layer: Callable[[int], nn.Module], *,
        rope_kernel: Callable | None = None, embed_scale: float | None = None,
        norm_offset: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, ctx, scale=embed_scale)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, ctx, weight_offset=norm_offset)
        self.rotary_emb = RotaryEmbedding(
            config.rope, config.max_position, ctx, fused_kernel=rope_kernel
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """forward(batch) -> final-normed hidden [T, H]; the (restricted) LM head lives outside.
    Holds `model` (a DecoderModel) and an untied `output_head` when embeddings are not tied."""

    def __init__(self, config: ModelConfig, ctx: BuildContext, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
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
