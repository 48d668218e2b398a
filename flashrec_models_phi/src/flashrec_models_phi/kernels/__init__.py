"""Phi's own fused kernels, each Triton kernel `foo` with a pure-torch `foo_ref` of the same math.

The shared kernels (flashrec_kernels) cover RMSNorm and SiLU*mul; Phi needs LayerNorm (with bias)
and a non-gated GELU(tanh), both quantizing to the shared per-token FP8 format. Importing this
package never imports triton: the kernels live in the `triton_*` modules, which the wrappers
import on first launch. They quantize through `flashrec_kernels.triton_fp8`, so every FP8 producer
in FlashRec rounds the same way.
"""

from __future__ import annotations

from .gelu import gelu_tanh_quant_fp8, gelu_tanh_quant_fp8_ref
from .layer_norm import layer_norm_quant_fp8, layer_norm_quant_fp8_ref

__all__ = [
    "gelu_tanh_quant_fp8",
    "gelu_tanh_quant_fp8_ref",
    "layer_norm_quant_fp8",
    "layer_norm_quant_fp8_ref",
]
