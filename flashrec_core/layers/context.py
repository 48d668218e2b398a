"""What a model constructor is built with: device, dtypes and the resolved fused paths."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class BuildContext:
    """Everything a model needs to build its layers, decided once at build time.

    `fused` maps each enabled fused-path name to its kernel; a path absent from it runs its eager
    fallback. Layers read it in their constructors, never per call.
    """

    device: torch.device
    dtype: torch.dtype
    fp8_linear: bool = False
    kv_dtype: torch.dtype | None = None
    fused: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    triton: bool = False
    """Whether the shared Triton kernels run here (the per-token FP8 quantizer of Linear inputs
    that no fused producer quantized, e.g. the attention output before o_proj)."""

    small_gemm_rows: int | None = 0
    """FP8 Linear inputs of at most this many rows run through the Triton small-row GEMM
    (`flashrec_kernels.fp8_gemm`); 0: never; None: per Linear, as far as the GPU's launch table
    measured it faster for that weight shape (`fp8_gemm_rows`). From
    EngineConfig.fp8_gemm_triton_rows, 0 where Triton kernels cannot run."""

    def kernel(self, path: str) -> Callable[..., Any] | None:
        """The kernel of an enabled fused path, or None when the eager fallback must run."""
        return self.fused.get(path)

    def enabled(self, path: str) -> bool:
        return path in self.fused
