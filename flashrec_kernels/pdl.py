"""Programmatic dependent launch (PDL) of the Triton kernels: an experiment, off unless
FLASHREC_PDL=1.

On Hopper (sm_90) a kernel launched with PDL may be scheduled while the kernel ahead of it in
the stream is still finishing, instead of after it has drained. Every kernel that takes
`USE_GDC` then waits (`griddepcontrol.wait`, Triton's `gdc_wait`) as its first instruction
until that kernel has completed and its writes are visible, so what overlaps is the launch and
block scheduling, not any memory access. A CUDA graph captured with such launches keeps them as
programmatic edges. The beam steps of a small wave are ~300 short kernels, where those gaps add
up (docs/benchmarks.md, session 43).

A kernel launched with PDL that did not wait would race its predecessor, so `pdl_launch` gives
the launch option and the kernel's switch together. Kernels launched without it (cuBLAS, the
plugins' kernels) serialize as always, and a PDL kernel after one of them waits for it.
"""

from __future__ import annotations

import functools
import os

import torch

from .device import triton_interpreting

__all__ = ["ENV", "pdl_launch"]

ENV = "FLASHREC_PDL"


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The `USE_GDC` switch and the `launch_pdl` option of a launch on `device`: on when
    FLASHREC_PDL=1 and the kernel compiles for a GPU of sm_90 or later (a CUDA device that is
    one, or a CPU tensor outside the interpreter: `gpu_compile`'s compile-only launches)."""
    on = os.environ.get(ENV, "") == "1" and not triton_interpreting()
    if on and device.type == "cuda":
        on = _sm90_or_later(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    return {"USE_GDC": on, "launch_pdl": on}
