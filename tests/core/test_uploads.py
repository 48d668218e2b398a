"""Off CUDA an upload is the tensor itself: the CPU engine's paths copy nothing (the pinned
staging of flashrec_core/uploads.py runs natively in tests/gpu/test_pinned_uploads.py)."""

from __future__ import annotations

import torch

from flashrec_core.uploads import staged, upload


def test_a_host_tensor_bound_for_the_host_is_neither_pinned_nor_copied() -> None:
    t = torch.arange(6)
    cpu = torch.device("cpu")
    assert staged(t, cpu) is t
    assert upload(t, cpu) is t and not t.is_pinned()
