"""Triton kernel of `fp8_gemm`: one program per (row tile, column tile), each over the whole K
(a compile-time constant: a model has a few distinct K, and the interpreter cannot loop to a
runtime bound); or, with split-K, `split_k` programs per tile, each over its share of K, writing
fp32 partials that a second kernel sums in split order, then scales (more programs, each with
fewer dependent K steps: with a few rows a program's time is mostly the latency of its loads,
not their bytes).

The row tiles are the fastest grid axis, so the programs that read one column tile of the weights
run side by side and share it through L2. The column tile is as wide as leaves at least one
program per SM (`launch_config`): with few rows, the work is reading the weights, and every SM
must stream its share of them. That heuristic is a first guess, not yet timed on a GPU;
scripts/bench_gemm.py sweeps launches against `torch._scaled_mm` and writes the fastest per
weight shape and row count as a launch table, which this module reads for the GPU it runs on
(`fp8_gemm_configs/<device name>.json`, as vLLM ships its tuned Triton GEMM configs).
"""

from __future__ import annotations

import functools
from dataclasses import asdict

import torch
import triton
import triton.language as tl

from .fp8_gemm_tables import LaunchConfig, TunedTable, config_file, tuned_table
from .triton_fp8 import cast_for_store

__all__ = ["launch_config", "launch_fp8_gemm"]

_DEFAULT_SMS = 132  # an H100 SXM's SM count, for launches planned without a GPU (interpreter)


def launch_config(
    m: int, n: int, k: int, sms: int = _DEFAULT_SMS, table: TunedTable | None = None
) -> LaunchConfig:
    """The tuned launch of the smallest timed row count >= m for this weight shape (the largest
    when m is beyond them all), when `table` has the shape. Else a heuristic: rows in tiles of
    16-64 (one tile for a beam step of up to 64 rows); the widest column tile (16-128) that still
    gives every SM a program; K in steps of up to 256 codes."""
    tuned = (table or {}).get((n, k))
    if tuned is not None and tuned.launches:
        return next((cfg for rows, cfg in tuned.launches if m <= rows), tuned.launches[-1][1])
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    row_tiles = triton.cdiv(m, block_m)
    block_n = 16
    for width in (128, 64, 32):
        if triton.cdiv(n, width) * row_tiles >= sms:
            block_n = width
            break
    block_k = min(256, max(32, triton.next_power_of_2(k)))
    return LaunchConfig(block_m, block_n, block_k)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N,
    stride_am, stride_wn, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
):  # fmt: skip
    """SPLIT_K > 1: this program sums K [split * K_SPLIT, (split + 1) * K_SPLIT) (K_SPLIT a
    multiple of BLOCK_K) into partial `split` of out_ptr, fp32 [SPLIT_K, M, N], unscaled."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    ks = split * K_SPLIT + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:  # every split's K range inside K
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        # e4m3 x e4m3 -> fp32, exact products. Hopper's fp8 tensor cores sum in a narrower
        # accumulator (~14 bits, DeepSeek-V3 report 3.3.2), and on sm_90 Triton's default keeps
        # all of K there; at most 128 elements per fp32 promotion is what CUTLASS's precise FP8
        # schedule does (torch._scaled_mm without use_fast_accum). 0 would be fp32 throughout
        # but makes Triton give up wgmma for mma.sync (and spill); 128 keeps wgmma, no spills.
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=IMPRECISE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K > 1:
        part = out_ptr + split.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        _store_scaled(acc, rows, cols, row_ok, col_ok, a_scale_ptr, w_scale_ptr, bias_ptr,
                      out_ptr, stride_om, HAS_BIAS)  # fmt: skip


@triton.jit
def _store_scaled(
    acc, rows, cols, row_ok, col_ok, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_om,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """out[rows, cols] = acc * a_scale[rows] * w_scale[cols] (+ bias[cols]), rounded once."""
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    y = acc * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(
        out_ptrs,
        cast_for_store(y, out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _split_k_sum_kernel(
    part_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Sum the SPLIT_K fp32 partials [SPLIT_K, M, N] of a tile in split order, then scale."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ptrs = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.load(ptrs, mask=tile_ok, other=0.0)
    for split in range(1, SPLIT_K):
        acc += tl.load(ptrs + split * M * N, mask=tile_ok, other=0.0)
    _store_scaled(acc, rows, cols, row_ok, col_ok, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
                  stride_om, HAS_BIAS)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _planned(m: int, n: int, k: int, cuda_index: int | None) -> LaunchConfig:
    """`launch_config` for this GPU (its SM count and launch table), once per shape: an eager
    step launches each projection's GEMM every layer, and this Python runs before each."""
    if cuda_index is None:
        return launch_config(m, n, k)
    props = torch.cuda.get_device_properties(cuda_index)
    return launch_config(m, n, k, props.multi_processor_count, tuned_table(config_file(props.name)))


def launch_fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, **launch: int,
) -> torch.Tensor:  # fmt: skip
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    planned = _planned(m, n, k, a.device.index if a.is_cuda else None)
    cfg = LaunchConfig(**{**asdict(planned), **launch}) if launch else planned
    if cfg.split_k < 1:
        raise ValueError(f"fp8_gemm: split_k must be >= 1, got {cfg.split_k}")
    # each split a whole number of K steps; the last may reach past K (masked)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_split)  # no split left without K
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    bias_arg = bias if bias is not None else w_scale
    dest = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32,
                                                device=a.device)  # fmt: skip
    _fp8_gemm_kernel[grid](
        a, a_scale, w, w_scale, bias_arg, dest, m, n,
        a.stride(0), w.stride(0), out.stride(0),
        K=k, HAS_BIAS=bias is not None, EVEN_K=k_split * split_k == k,
        IMPRECISE=min(128, cfg.block_k),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split_k, K_SPLIT=k_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_k > 1:
        sum_grid = (triton.cdiv(m, _SUM_BLOCK_M), triton.cdiv(n, _SUM_BLOCK_N))
        _split_k_sum_kernel[sum_grid](
            dest, a_scale, w_scale, bias_arg, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k,
            BLOCK_M=_SUM_BLOCK_M, BLOCK_N=_SUM_BLOCK_N,
        )  # fmt: skip
    return out


_SUM_BLOCK_M, _SUM_BLOCK_N = 16, 128  # the partials' sum: 2,048 fp32 values a program
