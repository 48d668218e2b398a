"""The roofline floor of a wave: the GPU's measured peaks and the step's FLOPs and bytes.

The floor of one forward is max(FLOPs / GEMM peak, bytes / copy bandwidth): no implementation
can beat it. measured / floor says how close the engine runs to the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrec_core.spec import ModelConfig


@dataclass(frozen=True)
class Peaks:
    gemm_flops: float  # FLOP/s of the GEMM dtype the model uses
    copy_bytes: float  # bytes/s counting read + write


def measure_peaks(fp8: bool, device: torch.device) -> Peaks:
    """8192^3 GEMM (FP8 row-wise `_scaled_mm` or BF16) and a 4 GiB device copy, timed with
    triton.testing.do_bench (CUDA events)."""
    from triton.testing import do_bench

    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        sa = torch.ones(m, 1, device=device)
        sb = torch.ones(1, m, device=device)
        ms = do_bench(
            lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        )
    else:
        ms = do_bench(lambda: a @ b)
    src = torch.empty(1 << 31, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    return Peaks(2 * m**3 / (ms * 1e-3), 2 * src.numel() * 2 / (copy_ms * 1e-3))


@dataclass(frozen=True)
class WaveCost:
    flops: float
    bytes: float
    floor_seconds: float


def wave_cost(
    cfg: ModelConfig,
    peaks: Peaks,
    prompt_lens: list[int],
    widths: list[int],
    level_sizes: tuple[int, ...],
    weight_bytes: float,
    kv_bytes: float,
    cascade: bool,
) -> WaveCost:
    """FLOPs and bytes of one wave (prefill + depth-1 decode steps) and its roofline floor.

    Linear FLOPs are 2 x params x tokens; attention 4 x Hq x D per query-key pair; the
    restricted head 2 x rows x K x H. Bytes: every forward reads the weights once; prefill
    writes the prompt KV; a decode step reads each prompt's KV once per request with cascade
    (once per beam without) plus the beams' own decode KV.
    """
    h, layers = cfg.hidden_size, cfg.num_layers
    q_size, kv_size = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear_params = layers * (
        h * (q_size + 2 * kv_size) + q_size * h + 3 * h * cfg.intermediate_size
    )
    kv_per_token = 2 * kv_size * layers * kv_bytes
    attn = 4 * cfg.num_q_heads * cfg.head_dim * layers
    tokens = sum(prompt_lens)
    flops = 2 * linear_params * tokens + attn * sum(p * (p + 1) / 2 for p in prompt_lens)
    flops += 2 * len(prompt_lens) * level_sizes[0] * h
    bytes_ = weight_bytes + tokens * kv_per_token
    floor = max(flops / peaks.gemm_flops, bytes_ / peaks.copy_bytes)
    rows = sum(widths)
    for step in range(1, len(level_sizes)):
        ctx = sum(w * (p + step) for w, p in zip(widths, prompt_lens))
        f = 2 * linear_params * rows + attn * ctx + 2 * rows * level_sizes[step] * h
        prompt_reads = tokens if cascade else sum(w * p for w, p in zip(widths, prompt_lens))
        b = weight_bytes + (prompt_reads + rows * (step + 1)) * kv_per_token
        flops, bytes_ = flops + f, bytes_ + b
        floor += max(f / peaks.gemm_flops, b / peaks.copy_bytes)
    return WaveCost(flops, bytes_, floor)
