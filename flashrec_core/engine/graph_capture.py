"""Capturing one CUDA graph, the step every graph runner of the engine shares (the decode
graphs of engine/cuda_graph.py and the prefill graphs of engine/prefill_graph.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def record_graph(body: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `body` into a graph of memory pool `pool`, after one run outside it on a side
    stream (Triton compiles, cuBLAS picks its algorithms; it writes the same K/V the replay
    writes, so it is harmless). Returns the graph and the captured output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = body()
    return graph, output
