"""Host-built inputs onto the GPU without stalling the engine thread.

The loop builds each prefill's and each step's inputs (token ids, positions, slots, index
pointers) as host tensors and copies them over with `non_blocking=True`. From pageable memory
that is not asynchronous: the driver stages the bytes through a pinned buffer of its own and
may first wait for the work already queued on the stream (CUDA's notes on API synchronization
behaviour). In the engine loop that work is the step or prefill in flight, so the host stalls
on each of the admission's uploads and the GPU then idles while the host builds the next one.
Session 42's trace of `Engine.generate` at n=512 counted 28 such uploads an iteration in the
admission phase, whose 180 copy calls took 26.4 ms of host (147 us each; the step phase's 120,
23 us each), and most GPU idle gaps over 20 us ended at one of them (`bench/trace_summary.py`
counts both).

From pinned memory the copy is queued and the host goes on. `pin_memory()` copies the tensor
into a block of torch's caching host allocator, which records the copy's stream and does not
hand the block out again before the copy has run, so the caller may change or drop its tensor
at once, as it could after a pageable copy.
"""

from __future__ import annotations

import torch

__all__ = ["staged", "upload"]


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` ready to be copied to `device` without a host stall: a pinned copy of a host tensor
    bound for a CUDA device, else `t` itself. Refused inside a CUDA graph capture, where the
    copy would be recorded with this pinned block as its source, and every replay would read
    whatever the block holds by then."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a host tensor was uploaded inside a CUDA graph capture: copy it into the graph's "
            "static input buffer before capturing or replaying instead"
        )
    return t.pin_memory()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, copied without stalling the host (`staged`); a tensor already there is
    returned as is."""
    return staged(t, device).to(device, non_blocking=True)
