"""The ready log's CUDA-graph memory: the allocator's private-pool segments of the server's device
(torch's snapshot stands in for a GPU's here: its format, not our code, is what is replaced)."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.server.loading import graph_pool_bytes


def test_graph_pool_bytes_sum_the_private_pools_of_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    segments = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (0, 0)},  # the default pool
        {"device": 0, "total_size": 3 << 20, "segment_pool_id": (0, 1)},  # a graph pool
        {"device": 0, "total_size": 5 << 20, "segment_pool_id": (1, 0)},  # another one
        {"device": 1, "total_size": 7 << 20, "segment_pool_id": (0, 1)},  # another device
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert graph_pool_bytes(torch.device("cuda", 0)) == 8 << 20
    assert graph_pool_bytes(torch.device("cuda")) == 8 << 20  # no index: the current device
    assert graph_pool_bytes(torch.device("cuda", 1)) == 7 << 20
