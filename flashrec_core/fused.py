"""The fused kernel paths the shared kernels (flashrec_kernels) implement.

A spec lists the paths its structure allows; a plugin whose structure the shared kernels do not
cover (LayerNorm, GELU) declares its own `FusedPath` pointing at a kernel in its package.
Torch-free: kernels are referenced by import string.
"""

from __future__ import annotations

from flashrec_core.spec import FusedPath

RMS_NORM_FP8 = FusedPath(
    name="rms_norm_fp8",
    switch="enable_fused_rms_fp8",
    kernel="flashrec_kernels:rms_norm_quant_fp8",
    description="residual add + RMSNorm, quantized to FP8 with a per-token scale",
    requires=("triton", "fp8_linear"),
)
SILU_MUL_FP8 = FusedPath(
    name="silu_mul_fp8",
    switch="enable_fused_silu_fp8",
    kernel="flashrec_kernels:silu_mul_quant_fp8",
    description="SiLU(gate) * up, quantized to FP8 with a per-token scale",
    requires=("triton", "fp8_linear"),
)
GELU_MUL_FP8 = FusedPath(
    name="gelu_mul_fp8",
    switch="enable_fused_gelu_mul_fp8",
    kernel="flashrec_kernels:gelu_tanh_mul_quant_fp8",
    description="GELU-tanh(gate) * up (GeGLU), quantized to FP8 with a per-token scale",
    requires=("triton", "fp8_linear"),
)
QK_NORM_ROPE_KV = FusedPath(
    name="qk_norm_rope_kv",
    switch="enable_fused_qk_rope_kv",
    kernel="flashrec_kernels:rope_norm_store",
    description="per-head q/k RMSNorm + RoPE + K/V store into the pool, one kernel",
)
ROPE_KV = FusedPath(
    name="rope_kv",
    switch="enable_fused_qk_rope_kv",
    kernel="flashrec_kernels:rope_norm_store",
    description="RoPE + K/V store into the pool (no q/k norm), one kernel",
)

SHARED_PATHS = (RMS_NORM_FP8, SILU_MUL_FP8, GELU_MUL_FP8, QK_NORM_ROPE_KV, ROPE_KV)
