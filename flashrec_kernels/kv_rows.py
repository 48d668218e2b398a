"""Copy cached K/V slots into rows of two dense buffers, converting the dtype: one kernel.

    k_dst[rows[i]] = k_src[slots[i]].to(k_dst.dtype);  v_dst[rows[i]] = v_src[slots[i]].to(...)

Why: a fresh prefill (flashrec_core/attention/fresh_prefill.py) attends over dense buffers in
the model's dtype and copies each prompt's cached context there from the pool. In torch that is
a gather, a conversion and a scatter for each of K and V, six launches of a few hundred rows:
launch-bound. Here it is one. From an FP8 cache the conversion is exact (bf16 and fp16 hold
every e4m3 value). `slots=None` reads source rows 0, 1, ... in order: the step's own K/V, strided
views of the qkv projection, where `index_copy_` took 55 us a layer for eight 960-token prompts
on an H100 (docs/benchmarks.md, session 38).

`count`, optional: a one-element int tensor on the device; only the first count[0] rows are
copied. A CUDA graph's launch is sized for the most rows it may copy, and the real number
changes from replay to replay without a host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .device import check_triton_device

__all__ = ["copy_kv_rows", "copy_kv_rows_ref"]

_KERNEL = "copy_kv_rows"


def check_kv_rows_args(
    k_src: Tensor, v_src: Tensor, slots: Tensor | None, k_dst: Tensor, v_dst: Tensor, rows: Tensor,
    count: Tensor | None = None,
) -> None:  # fmt: skip
    """Validate every argument of `copy_kv_rows`."""
    shape = k_src.shape[1:]
    for name, t in (("k_src", k_src), ("v_src", v_src), ("k_dst", k_dst), ("v_dst", v_dst)):
        if t.dim() != 3 or t.shape[1:] != shape:
            raise ValueError(
                f"{_KERNEL}: {name} must be [n, {', '.join(map(str, shape))}] like k_src, got "
                f"{tuple(t.shape)}"
            )
        if t.stride(2) != 1:
            raise ValueError(f"{_KERNEL}: {name} needs unit stride along D, got {t.stride()}")
    for name, idx in (("slots", slots), ("rows", rows)):
        if idx is not None and (idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32)):
            raise ValueError(
                f"{_KERNEL}: {name} must be int64/int32 [n], got {idx.dtype} {idx.shape}"
            )
    if slots is not None and slots.shape != rows.shape:
        raise ValueError(f"{_KERNEL}: {slots.numel()} slots but {rows.numel()} rows")
    if slots is None and min(k_src.shape[0], v_src.shape[0]) < rows.numel():
        raise ValueError(
            f"{_KERNEL}: {rows.numel()} rows but the sources have {k_src.shape[0]} and "
            f"{v_src.shape[0]} (slots=None reads their first rows)"
        )
    if count is not None and (count.numel() != 1 or count.dtype not in (torch.int64, torch.int32)):
        raise ValueError(
            f"{_KERNEL}: count must be one int64/int32, got {count.dtype} {count.shape}"
        )


def copy_kv_rows_ref(
    k_src: Tensor, v_src: Tensor, slots: Tensor | None, k_dst: Tensor, v_dst: Tensor, rows: Tensor,
    count: Tensor | None = None,
) -> None:  # fmt: skip
    """Torch reference: gather, convert, scatter, for K and for V (reads `count` on the host:
    not for CUDA graphs)."""
    check_kv_rows_args(k_src, v_src, slots, k_dst, v_dst, rows, count)
    if slots is None:
        slots = torch.arange(rows.numel(), device=rows.device)
    if count is not None:
        slots, rows = slots[: int(count)], rows[: int(count)]
    for src, dst in ((k_src, k_dst), (v_src, v_dst)):
        dst.index_copy_(0, rows.long(), src.index_select(0, slots.long()).to(dst.dtype))


def copy_kv_rows(
    k_src: Tensor, v_src: Tensor, slots: Tensor | None, k_dst: Tensor, v_dst: Tensor, rows: Tensor,
    count: Tensor | None = None,
) -> None:  # fmt: skip
    """Triton version of `copy_kv_rows_ref`: one launch for K and V, a few rows a program."""
    check_kv_rows_args(k_src, v_src, slots, k_dst, v_dst, rows, count)
    check_triton_device(k_src, _KERNEL)
    from .triton_kv_rows import launch_copy_kv_rows

    launch_copy_kv_rows(k_src, v_src, slots, k_dst, v_dst, rows, count)
