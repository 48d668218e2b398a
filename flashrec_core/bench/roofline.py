"""The roofline floor of a wave: the GPU's measured peaks and the step's FLOPs and bytes.

The floor of one forward is max(FLOPs / GEMM peak, bytes / copy bandwidth): no implementation
can beat it. measured / floor says how close the engine runs to the hardware.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from flashrec_core.spec import ModelConfig


@dataclass(frozen=True)
class Peaks:
    gemm_flops: float  # FLOP/s of the GEMM dtype the model uses
    copy_bytes: float  # bytes/s counting read + write

    def fields(self) -> dict[str, float]:
        """The peaks as every bench output reports them beside its floor: a floor that moves
        between runs moves with one of them."""
        return {
            "peak_gemm_tflops": self.gemm_flops / 1e12,
            "peak_copy_tb_per_s": self.copy_bytes / 1e12,
        }


def measure_peaks(fp8: bool, device: torch.device, copy_gib: int = 4) -> Peaks:
    """8192^3 GEMM (FP8 row-wise `_scaled_mm` or BF16) and a `copy_gib` GiB device copy, timed
    with triton.testing.do_bench (CUDA events). Any copy far over the L2 cache (50 MB on an
    H200) measures the same DRAM bandwidth; 4 GiB is the bench's, less fits beside a server."""
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
    src = torch.empty(copy_gib << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    return Peaks(2 * m**3 / (ms * 1e-3), 2 * src.numel() * 2 / (copy_ms * 1e-3))


def measure_peaks_beside(fp8: bool, device: torch.device, neighbour: str) -> Peaks | None:
    """`measure_peaks` on a card that `neighbour` (an engine, a server) mostly fills: the
    allocator's cached blocks handed back first and a 1 GiB copy, not 4 (still 20x the L2, the
    same DRAM bandwidth). None, with a line on stderr, when even that does not fit: on an 80 GiB
    H100 the 4 GiB copy ran out of memory beside an engine, and beside a warmed-up server not
    even a second process's CUDA context fit (a RuntimeError, so one is caught only while this
    process has no context yet; later it is a real error)."""
    fresh = not torch.cuda.is_initialized()
    if not fresh:
        torch.cuda.empty_cache()
    try:
        return measure_peaks(fp8, device, copy_gib=1)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not (isinstance(exc, torch.OutOfMemoryError) or fresh):
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"no GPU memory left beside the {neighbour} to measure peaks ({reason}): "
              "no roofline figures", file=sys.stderr)  # fmt: skip
        return None
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # hand the buffers back before the measured work


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


@dataclass(frozen=True)
class ServedModel:
    """What the floor of a served model depends on beyond its shape: the bytes a forward reads
    for weights (the LM head excluded: the restricted head reads only the SID rows), the KV
    element size, whether beam steps read each prompt once (cascade), and the scheduler's
    budgets that pack requests into waves. `served_model(engine)` gives it; the server's
    model card carries it for `flashrec bench --server`."""

    weight_bytes: float
    kv_bytes: float
    cascade: bool
    fp8: bool
    max_wave_rows: int
    max_requests: int
    kv_slots: int


def floor_seconds(
    cfg: ModelConfig,
    served: ServedModel,
    peaks: Peaks,
    requests: list[tuple[int, int]],
    level_sizes: tuple[int, ...],
) -> float:
    """The roofline floor of (prompt length, n) requests, packed into waves in order as the
    offline engine packs them (the same floor for every path that serves them)."""
    from flashrec_core.engine.requests import GenerationRequest
    from flashrec_core.engine.scheduler import plan_waves

    reqs = [GenerationRequest(tuple(range(p)), n) for p, n in requests]
    waves = plan_waves(reqs, depth=len(level_sizes), max_rows=served.max_wave_rows,
                       max_requests=served.max_requests, kv_slots=served.kv_slots)  # fmt: skip
    return sum(
        wave_cost(cfg, peaks, [requests[i][0] for i in w], [requests[i][1] for i in w],
                  level_sizes, served.weight_bytes, served.kv_bytes, served.cascade).floor_seconds
        for w in waves
    )  # fmt: skip


def served_model(engine: Any) -> ServedModel:
    """The ServedModel of a loaded `Engine`."""
    runner = engine.runner
    cfg = runner.loaded.engine_config
    head = runner.lm_head()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return ServedModel(
        weight_bytes=weights - head.numel() * head.element_size(),
        kv_bytes=runner.kv_pool.dtype.itemsize, cascade=cfg.cascade_attention,
        fp8=cfg.quantization == "fp8", max_wave_rows=cfg.max_wave_rows,
        max_requests=cfg.max_requests, kv_slots=runner.allocator.num_slots - 1,
    )  # fmt: skip
