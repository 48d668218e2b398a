"""Programmatic dependent launch (PDL) of the Triton kernels: an experiment, off unless
FLASHREC_PDL is 1, 2 or 3.

On Hopper (sm_90) a kernel launched with PDL may be scheduled while the kernel ahead of it in
the stream is still finishing, instead of after it has drained. Every kernel that takes
`USE_GDC` then waits (`griddepcontrol.wait`, Triton's `gdc_wait`) as its first instruction
until that kernel has completed and its writes are visible, so what overlaps is the launch and
block scheduling, not any memory access. A CUDA graph captured with such launches keeps them as
programmatic edges. The beam steps of a small wave are ~300 short kernels, where those gaps add
up (docs/benchmarks.md, session 43).

With FLASHREC_PDL=2 each kernel also signals, right after its wait, that the next one may
launch (`gdc_launch_dependents`): the next kernel's blocks can then be resident and waiting
before this one ends, instead of launching as its blocks exit. That helps a chain of small
kernels and may cost a large one the SM slots its waiting successor holds; the device decides.
FLASHREC_PDL=3 is 2, and the small-row FP8 GEMM asks L2 for its slice of the weights before
its wait (`prefetch_to_l2`): weights are no kernel's output, and with a few rows the GEMM's
time is mostly waiting for them, which can then overlap the kernel ahead of it.

A kernel launched with PDL that did not wait would race its predecessor, so `pdl_launch` gives
the launch option and the kernel's switch together. Kernels launched without it (cuBLAS, the
plugins' kernels) serialize as always, and a PDL kernel after one of them waits for it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .device import triton_interpreting

__all__ = ["ENV", "pdl_launch", "prefetch_to_l2", "wait_for_predecessor"]

ENV = "FLASHREC_PDL"


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, int | bool]:
    """The `USE_GDC` switch (0 off, 1 wait, 2 wait and release the next launch, 3 as 2 with
    the GEMM's weight prefetch) and the `launch_pdl` option of a launch on `device`: FLASHREC_PDL's
    mode where the kernel compiles for a GPU of sm_90 or later (a CUDA device that is one, or a
    CPU tensor outside the interpreter: `gpu_compile`'s compile-only launches), else 0. Read
    at every launch, so that one process can switch it (tests/gpu/test_pdl.py does): about 1.5
    us of host, mostly the two environment reads; graph replays do not launch, and caching by
    the variables' values saved nothing (measured on the CPU machine)."""
    mode = {"1": 1, "2": 2, "3": 3}.get(os.environ.get(ENV, ""), 0)
    if triton_interpreting():
        mode = 0
    elif mode and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        mode = mode if _sm90_or_later(index) else 0
    return {"USE_GDC": mode, "launch_pdl": mode > 0}


@triton.jit
def wait_for_predecessor(USE_GDC: tl.constexpr):
    """A kernel's first statement: with PDL, wait until the kernel ahead of it in the stream
    has completed and its writes are visible (and from USE_GDC 2 on, let the next one launch)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if USE_GDC >= 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs):
    """Ask L2 for the line at each pointer of `ptrs` without waiting for it (PTX `prefetch`);
    not in the interpreter, which has no inline assembly."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip
