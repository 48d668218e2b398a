"""Building blocks that model plugins compose (imported by plugins as `flashrec_core.layers`)."""

from flashrec_core.layers.activation import GeluAndMul, SiluAndMul, gelu_tanh_and_mul, silu_and_mul
from flashrec_core.layers.attention import Attention, split_qkv
from flashrec_core.layers.batch import ForwardBatch
from flashrec_core.layers.blocks import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    SelfAttention,
    block_norm,
)
from flashrec_core.layers.context import BuildContext
from flashrec_core.layers.embedding import Embedding
from flashrec_core.layers.gelu import GeluTanh, gelu_tanh
from flashrec_core.layers.layer_norm import LayerNorm, layer_norm
from flashrec_core.layers.linear import Linear
from flashrec_core.layers.norm import RMSNorm, rms_norm
from flashrec_core.layers.quant import (
    FP8_DTYPE,
    QuantizedActivation,
    fp8_linear,
    quantize_per_token,
    quantize_weight_per_channel,
)
from flashrec_core.layers.rotary import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = [
    "FP8_DTYPE",
    "Attention",
    "BuildContext",
    "CausalLM",
    "DecoderModel",
    "Embedding",
    "ForwardBatch",
    "GatedMLP",
    "GeluAndMul",
    "GeluTanh",
    "LayerNorm",
    "Linear",
    "PreNormDecoderLayer",
    "QuantizedActivation",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "SiluAndMul",
    "apply_rope",
    "block_norm",
    "fp8_linear",
    "gelu_tanh",
    "gelu_tanh_and_mul",
    "layer_norm",
    "quantize_per_token",
    "quantize_weight_per_channel",
    "rms_norm",
    "rope_inv_freq",
    "silu_and_mul",
    "split_qkv",
]
