"""copy_kv_rows: the Triton kernel against the reference, exact (a copy and an exact cast)."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, copy_kv_rows, copy_kv_rows_ref

CASES = {
    # name: (source dtype, destination dtype, kv heads, head dim, rows)
    "fp8-to-bf16": (FP8_DTYPE, torch.bfloat16, 8, 128, 7),
    "bf16-to-bf16": (torch.bfloat16, torch.bfloat16, 2, 64, 4),
    "fp8-to-fp16-odd-heads": (FP8_DTYPE, torch.float16, 3, 80, 9),
    "fp32-to-fp32-one-row": (torch.float32, torch.float32, 1, 16, 1),
}


def _source(dtype: torch.dtype, slots: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, heads, dim, generator=gen) * 30).clamp(-448, 448).to(dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_ref(device: torch.device, case: str) -> None:
    """Rows land exactly where the reference puts them (the last program partly masked); the
    other rows keep their sentinel; int32 indices read with a stride, as a column of a table."""
    src_dtype, dst_dtype, heads, dim, n = CASES[case]
    k_src = _source(src_dtype, 40, heads, dim, seed=1).to(device)
    v_src = _source(src_dtype, 40, heads, dim, seed=2).to(device)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(40, generator=gen)[:n]
    rows = torch.randperm(2 * n + 3, generator=gen)[:n]
    table = torch.stack([rows, slots, rows], dim=1).to(torch.int32).to(device)  # strided columns
    outs = []
    for fn in (copy_kv_rows, copy_kv_rows_ref):
        k_dst = torch.full((2 * n + 3, heads, dim), -5.0, device=device).to(dst_dtype)
        v_dst = torch.full((2 * n + 3, heads, dim), -6.0, device=device).to(dst_dtype)
        fn(k_src, v_src, table[:, 1], k_dst, v_dst, table[:, 0])
        outs.append((k_dst, v_dst))
    (k, v), (k_ref, v_ref) = outs
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(k[rows.to(device)], k_src[slots.to(device)].to(dst_dtype))
    untouched = torch.ones(2 * n + 3, dtype=torch.bool)
    untouched[rows] = False
    assert (k[untouched.to(device)] == -5).all() and (v[untouched.to(device)] == -6).all()


@pytest.mark.parametrize("copied", [0, 3, 9], ids=["none", "some", "all"])
def test_count_limits_the_rows(device: torch.device, copied: int) -> None:
    """With a device count, rows past it are left alone (a graph's launch sized for 9 rows,
    replayed with fewer); the reference copies the same."""
    k_src = _source(FP8_DTYPE, 20, 2, 32, seed=4).to(device)
    v_src = _source(FP8_DTYPE, 20, 2, 32, seed=5).to(device)
    slots = torch.arange(9, device=device) * 2
    rows = torch.arange(9, device=device).flip(0)
    count = torch.tensor([copied], device=device)
    outs = []
    for fn in (copy_kv_rows, copy_kv_rows_ref):
        k_dst = torch.zeros(9, 2, 32, dtype=torch.bfloat16, device=device)
        v_dst = torch.zeros(9, 2, 32, dtype=torch.bfloat16, device=device)
        fn(k_src, v_src, slots, k_dst, v_dst, rows, count)
        outs.append((k_dst, v_dst))
    (k, v), (k_ref, v_ref) = outs
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    written = rows[:copied]
    assert torch.equal(v[written], v_src[slots[:copied]].to(torch.bfloat16))
    assert int((k.abs().sum(dim=(1, 2)) != 0).sum()) == copied  # random rows: none all zero


def test_without_slots_reads_strided_sources_in_order(device: torch.device) -> None:
    """slots=None: source row i (k and v strided views of one qkv buffer, as a layer's are) to
    destination row rows[i], in the destination's dtype; the reference does the same."""
    qkv = (torch.randn(6, 4 * 32 + 8, generator=torch.Generator().manual_seed(7)) * 3).to(
        torch.bfloat16
    )
    qkv = qkv.to(device)
    k, v = qkv[:, 64:96].view(6, 1, 32), qkv[:, 96:128].view(6, 1, 32)
    assert k.stride(0) == 4 * 32 + 8
    rows = torch.tensor([3, 8, 0, 5, 1, 6], device=device)
    outs = []
    for fn in (copy_kv_rows, copy_kv_rows_ref):
        k_dst = torch.full((9, 1, 32), -1.0, device=device)
        v_dst = torch.full((9, 1, 32), -1.0, device=device)
        fn(k, v, None, k_dst, v_dst, rows)
        outs.append((k_dst, v_dst))
    (k_dst, v_dst), ref = outs
    assert torch.equal(k_dst, ref[0]) and torch.equal(v_dst, ref[1])
    assert torch.equal(k_dst[rows], k.float()) and torch.equal(v_dst[rows], v.float())
    assert (k_dst[[2, 4, 7]] == -1).all()


def test_no_rows(device: torch.device) -> None:
    src = torch.zeros(4, 1, 16, device=device)
    dst = torch.full((2, 1, 16), 3.0, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    copy_kv_rows(src, src, empty, dst, dst, empty)
    assert (dst == 3).all()


def test_rejects_bad_arguments() -> None:
    src, dst, idx = torch.zeros(4, 2, 16), torch.zeros(3, 2, 16), torch.arange(2)
    with pytest.raises(ValueError, match=r"v_dst must be \[n, 2, 16\] like k_src, got \(3, 2, 8\)"):
        copy_kv_rows_ref(src, src, idx, dst, dst[..., :8], idx)
    with pytest.raises(ValueError, match="rows must be int64/int32"):
        copy_kv_rows_ref(src, src, idx, dst, dst, idx.float())
    with pytest.raises(ValueError, match="count must be one int64/int32"):
        copy_kv_rows_ref(src, src, idx, dst, dst, idx, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"4 rows but the sources have 3 and 3 \(slots=None"):
        copy_kv_rows_ref(dst, dst, None, dst, dst, torch.arange(4))
    with pytest.raises(ValueError, match="2 slots but 3 rows"):
        copy_kv_rows(src, src, idx, dst, dst, torch.arange(3))
