"""Which CUDA-graph shape a wave replays, decided before capture (pure logic: runs on CPU)."""

from __future__ import annotations

from flashrec_core.engine.cuda_graph import capture_request_counts, graph_padding
from flashrec_core.server.warmup import warm_counts


def test_capture_counts_are_a_ladder_ending_at_the_fullest_wave() -> None:
    assert capture_request_counts(50, 8192) == [1, 2, 4, *range(8, 161, 8), 163]
    assert capture_request_counts(512, 8192) == [1, 2, 4, 8, 16]
    assert capture_request_counts(4096, 8192) == [1, 2]
    assert capture_request_counts(10_000, 8192) == []


def test_warm_up_captures_the_largest_wave_first() -> None:
    """Smaller captures then reuse the shared graph pool's blocks the largest one freed."""
    assert warm_counts(50, 8192) == [163, *range(160, 7, -8), 4, 2, 1]
    assert warm_counts(512, 8192) == [16, 8, 4, 2, 1]


def test_waves_pad_up_to_the_next_capture_size() -> None:
    assert graph_padding([50] * 160, False, 8192) == (160, "")
    assert graph_padding([50] * 80, False, 8192) == (80, "")
    assert graph_padding([50] * 161, False, 8192) == (163, "")
    assert graph_padding([8] * 3, False, 256) == (4, "")


def test_eager_waves_say_why() -> None:
    padded, why = graph_padding([4, 4], True, 256)
    assert padded is None and "sampling" in why
    padded, why = graph_padding([4, 8], False, 256)
    assert padded is None and "different n" in why
    padded, why = graph_padding([300], False, 256)
    assert padded is None and "exceed max_wave_rows 256" in why
