"""Host-to-device uploads through pinned memory (flashrec_core/uploads.py), natively: the values
arrive, the caller may overwrite its tensor at once, and an upload inside a CUDA graph capture is
refused instead of being baked into the graph."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.uploads import staged, upload

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_a_host_tensor_is_staged_in_pinned_memory_and_a_device_tensor_left_alone() -> None:
    host = torch.arange(10)
    pinned = staged(host, CUDA)
    assert pinned.is_pinned() and torch.equal(pinned, host)
    on_device = host.to(CUDA)
    assert staged(on_device, CUDA) is on_device and upload(on_device, CUDA) is on_device


def test_the_caller_may_overwrite_its_tensor_right_after_the_upload() -> None:
    # a long kernel queued first keeps the copy waiting on the stream while the host overwrites
    busy = torch.randn(4096, 4096, device=CUDA)
    for i in range(20):
        busy = busy @ busy / 64
        host = torch.full((1 << 20,), i, dtype=torch.int64)
        out = upload(host, CUDA)
        host.fill_(-1)
        assert int(out.min()) == i and int(out.max()) == i


def test_an_upload_inside_a_graph_capture_is_refused() -> None:
    graph, static = torch.cuda.CUDAGraph(), torch.zeros(4, dtype=torch.int64, device=CUDA)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(graph):
            static.copy_(staged(torch.arange(4), CUDA), non_blocking=True)
