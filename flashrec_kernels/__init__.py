"""Shared FlashRec kernels: each Triton kernel `foo` has a pure-torch `foo_ref` with the same math.

The CPU engine and the eager fallbacks call the `_ref` functions; the fused paths call the Triton
ones (CUDA, or CPU under TRITON_INTERPRET=1). Importing this package never imports triton: the
kernels live in the `triton_*` modules, which the wrappers import on first launch. Plugins writing
their own FP8 kernels reuse `flashrec_kernels.triton_fp8` (pre-rounded stores, row quantizer) and
test them with `flashrec_kernels.testing`.

Public: the names in `__all__` (and `triton_fp8`, `testing` for plugin kernels), with the promises
listed in docs/architecture.md ("Public flashrec_kernels functions"). The `launch_*` functions of
the `triton_*` modules and `gpu_compile` are internal and may change.
"""

from __future__ import annotations

from .beam_attention import beam_cascade_attention, beam_cascade_attention_ref
from .device import triton_available, triton_interpreting
from .fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_ABSMAX,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
    quantize_rows_ref,
)
from .fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_gemm_rows
from .kv_rows import copy_kv_rows, copy_kv_rows_ref
from .prefill_attention import prefill_attention, prefill_attention_ref, prefill_tiles
from .rms_norm import rms_norm_quant_fp8, rms_norm_quant_fp8_ref
from .rope import rope_norm_store, rope_norm_store_ref
from .silu_mul import (
    gelu_tanh_mul_quant_fp8,
    gelu_tanh_mul_quant_fp8_ref,
    silu_mul_quant_fp8,
    silu_mul_quant_fp8_ref,
)
from .trie_topk import (
    CsrLevel,
    DenseLevel,
    TrieTopK,
    pack_keys,
    stable_topk,
    trie_topk,
    trie_topk_ref,
)

__all__ = [
    "CsrLevel",
    "DenseLevel",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_ABSMAX",
    "TrieTopK",
    "beam_cascade_attention",
    "beam_cascade_attention_ref",
    "copy_kv_rows",
    "copy_kv_rows_ref",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_gemm_rows",
    "gelu_tanh_mul_quant_fp8",
    "gelu_tanh_mul_quant_fp8_ref",
    "pack_keys",
    "per_token_quant_fp8",
    "per_token_quant_fp8_ref",
    "prefill_attention",
    "prefill_attention_ref",
    "prefill_tiles",
    "quantize_rows_ref",
    "rms_norm_quant_fp8",
    "rms_norm_quant_fp8_ref",
    "rope_norm_store",
    "rope_norm_store_ref",
    "silu_mul_quant_fp8",
    "silu_mul_quant_fp8_ref",
    "stable_topk",
    "trie_topk",
    "trie_topk_ref",
    "triton_available",
    "triton_interpreting",
]
