"""prefill_attention: the reference against per-token fp64 attention, the Triton kernel against the ref.

Tolerances, as for beam_cascade_attention (tests/kernels/test_beam_attention.py): the reference is
fp32 math rounded to bf16, so against fp64 it is off by at most half a bf16 ulp (2^-8 relative)
plus fp32 summation error. The kernel feeds P to the PV dot as bf16 over a bf16 cache (each p_j
moves by <= 2^-9 relative while the normalizer keeps the fp32 sum: the output moves by <= 2^-9
max|v|) and as fp16 over an FP8 cache (<= 2^-12; the queries and keys convert exactly), and both
sides round to bf16 separately (one bf16 ulp, 2^-7 relative). Kernel vs ref: rtol 2^-7, atol
2^-9 max|v|.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, prefill_attention, prefill_attention_ref, prefill_tiles

NUM_SLOTS = 600
PAD = 16  # extra columns per fused qkv row, so q's row stride is not Hq * D
BLOCK_M, BLOCK_N = 16, 16  # small tiles: several tiles per sequence and chunks per tile


class Prefill(NamedTuple):
    q: torch.Tensor  # [T, Hq, D] bf16
    k_cache: torch.Tensor  # [NUM_SLOTS, Hkv, D]
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [sum of kv lens]
    sm_scale: float

    def ref_args(self) -> tuple:
        return tuple(self)

    def tiles(self, block_m: int = BLOCK_M, capacity: int | None = None) -> torch.Tensor:
        group = self.q.shape[1] // self.k_cache.shape[1]
        tiles = prefill_tiles(self.qo_indptr.cpu(), self.kv_indptr.cpu(), group, block_m, capacity)
        return tiles.to(self.q.device)

    def kernel_args(self, tiles: torch.Tensor) -> tuple:
        return (*self[:6], tiles, self.sm_scale)


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _make_prefill(
    new: list[int], cached: list[int], hq: int, hkv: int, d: int, cache_dtype: torch.dtype,
    device: torch.device | str = "cpu", *, seed: int = 0, strided: bool = False,
) -> Prefill:  # fmt: skip
    """Sequences of `new[b]` new tokens after `cached[b]` cached ones, over random distinct slots
    (as the slot allocator hands them out)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(new)
    if strided:  # q as the attention layer sees it: a view of the fused qkv buffer
        buf = torch.randn(tokens, (hq + 2 * hkv) * d + PAD, generator=gen) * 2
        q = buf.bfloat16().to(device)[:, : hq * d].view(tokens, hq, d)
    else:
        q = (torch.randn(tokens, hq, d, generator=gen) * 2).bfloat16().to(device)
    k_cache = (torch.randn(NUM_SLOTS, hkv, d, generator=gen) * 2).to(cache_dtype)
    v_cache = (torch.randn(NUM_SLOTS, hkv, d, generator=gen) * 2).to(cache_dtype)
    kv_lens = [n + c for n, c in zip(new, cached)]
    indices = torch.randperm(NUM_SLOTS, generator=gen)[: sum(kv_lens)].int()
    return Prefill(
        q, k_cache.to(device), v_cache.to(device), _indptr(new).to(device),
        _indptr(kv_lens).to(device), indices.to(device), d**-0.5,
    )  # fmt: skip


def _per_token_fp64(
    p: Prefill, cap: float | None = None, window: int | None = None
) -> torch.Tensor:
    """Independent spec: token by token, softmax over the keys at positions it may see, fp64."""
    hq = p.q.shape[1]
    group = hq // p.k_cache.shape[1]
    q, k, v = (t.cpu().double() for t in (p.q, p.k_cache, p.v_cache))
    out = torch.zeros(q.shape, dtype=torch.float64)
    qo, kv = p.qo_indptr.tolist(), p.kv_indptr.tolist()
    for b in range(len(qo) - 1):
        slots = p.kv_indices[kv[b] : kv[b + 1]].long().cpu()
        past = (kv[b + 1] - kv[b]) - (qo[b + 1] - qo[b])
        for i, t in enumerate(range(qo[b], qo[b + 1])):
            pos = past + i
            seen = slots[max(0, pos - window + 1) if window else 0 : pos + 1]
            for h in range(hq):
                scores = k[seen, h // group] @ q[t, h] * p.sm_scale
                if cap is not None:
                    scores = cap * torch.tanh(scores / cap)
                out[t, h] = torch.softmax(scores, dim=0) @ v[seen, h // group]
    return out


def _assert_kernel_matches_ref(out: torch.Tensor, ref: torch.Tensor, p: Prefill) -> None:
    v_max = float(p.v_cache.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-9 * v_max)


SOFTCAP = 2.0
"""Small enough that the cap bends most scores (|s| reaches ~8 here)."""


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize(
    "cap, window", [(None, None), (SOFTCAP, None), (None, 5)], ids=["plain", "softcap", "window"]
)
def test_ref_matches_per_token_fp64_attention(
    cache_dtype: torch.dtype, cap: float | None, window: int | None
) -> None:
    p = _make_prefill([4, 1, 7], [0, 6, 3], 4, 2, 16, cache_dtype, seed=1)
    ref = prefill_attention_ref(*p.ref_args(), logit_softcap=cap, window=window)
    assert ref.dtype == torch.bfloat16 and ref.shape == p.q.shape
    exact = _per_token_fp64(p, cap, window)
    torch.testing.assert_close(ref.cpu().double(), exact, rtol=2**-8, atol=1e-5)
    if cap is not None or window is not None:  # the option changed the answer
        plain = prefill_attention_ref(*p.ref_args())
        assert (plain.float() - ref.float()).abs().max() > 0.05


# (new tokens, cached tokens, Hq, Hkv, D): groups 1/2/4; fresh prompts, cached prefixes longer
# than a chunk, a one-token sequence, prompts spanning many tiles and diagonal chunks
KERNEL_CASES = [
    ([20, 1, 9], [0, 0, 0], 2, 2, 32),
    ([13, 6], [40, 3], 4, 2, 16),
    ([3, 30, 1, 8], [17, 0, 50, 16], 8, 2, 32),
]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"hq{c[2]}-hkv{c[3]}-d{c[4]}")
def test_kernel_matches_ref(case: tuple, cache_dtype: torch.dtype, device: torch.device) -> None:
    new, cached, hq, hkv, d = case
    p = _make_prefill(new, cached, hq, hkv, d, cache_dtype, device, seed=len(new))
    out = prefill_attention(*p.kernel_args(p.tiles()), block_m=BLOCK_M, block_n=BLOCK_N)
    _assert_kernel_matches_ref(out, prefill_attention_ref(*p.ref_args()), p)


@pytest.mark.parametrize("cap", [None, SOFTCAP], ids=["plain", "softcap"])
def test_fp8_scores_match_the_ref_on_fp8_rounded_queries(
    cap: float | None, device: torch.device, fp8_exact_queries: Callable
) -> None:
    """The experimental launch with the score dot on FP8 operands equals the reference given
    the queries it rounds (the dot of e4m3 codes is exact in fp32, the row scale applied after:
    the same tolerance as the bf16-query kernel; the queries from `fp8_exact_queries`)."""
    from flashrec_kernels.triton_prefill_attention import launch_prefill_attention

    p = _make_prefill([3, 30, 1, 8], [17, 0, 50, 16], 8, 2, 32, FP8_DTYPE, device, seed=4)
    q, rounded = fp8_exact_queries(p.q)
    p = p._replace(q=q)
    out = torch.empty_like(p.q)
    launch_prefill_attention(
        *p.kernel_args(p.tiles())[:7], p.sm_scale, out, cap, None, BLOCK_M, BLOCK_N,
        num_splits=1, fp8_scores=True,
    )  # fmt: skip
    ref = prefill_attention_ref(*p._replace(q=rounded).ref_args(), cap)
    _assert_kernel_matches_ref(out, ref, p)
    with pytest.raises(ValueError, match="fp8_scores needs an FP8 key cache"):
        bf16 = _make_prefill([3], [5], 2, 1, 16, torch.bfloat16, device)
        launch_prefill_attention(
            *bf16.kernel_args(bf16.tiles())[:7], bf16.sm_scale, torch.empty_like(bf16.q), None,
            None, BLOCK_M, BLOCK_N, fp8_scores=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    "cap, window", [(SOFTCAP, None), (None, 7), (SOFTCAP, 20)], ids=["softcap", "w7", "both"]
)
def test_softcap_and_window_match_the_ref(
    cap: float | None, window: int | None, device: torch.device
) -> None:
    # window 7 < a chunk: some chunks are skipped, others masked on both sides
    p = _make_prefill([25, 4], [30, 0], 4, 2, 16, FP8_DTYPE, device, seed=2)
    out = prefill_attention(
        *p.kernel_args(p.tiles()), logit_softcap=cap, window=window,
        block_m=BLOCK_M, block_n=BLOCK_N,
    )  # fmt: skip
    ref = prefill_attention_ref(*p.ref_args(), logit_softcap=cap, window=window)
    _assert_kernel_matches_ref(out, ref, p)


def test_strided_q_default_tiles_and_spare_programs(device: torch.device) -> None:
    """q as a view of the fused qkv output; the default 128-row tiles; a fixed-capacity map
    (a CUDA graph's) whose spare programs must write nothing."""
    p = _make_prefill([70, 5], [10, 90], 4, 2, 64, FP8_DTYPE, device, seed=3, strided=True)
    assert not p.q.is_contiguous()
    tiles = p.tiles(block_m=128, capacity=9)
    assert int((tiles[:, 0] < 0).sum()) == 9 - 3  # 140 + 10 packed rows: 2 tiles + 1
    out = prefill_attention(*p.kernel_args(tiles))
    _assert_kernel_matches_ref(out, prefill_attention_ref(*p.ref_args()), p)


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize(
    "cap, window", [(None, None), (SOFTCAP, 9)], ids=["plain", "softcap-window"]
)  # fmt: skip
def test_split_keys_merge_to_the_ref(
    splits: int, cap: float | None, window: int | None, device: torch.device
) -> None:
    """Split-KV: a few new tokens over long cached prompts (several chunks per split), a fresh
    prompt shorter than a chunk (every split but the first empty) and a window that leaves
    early splits empty, through spare programs of a fixed-capacity tile map."""
    p = _make_prefill([3, 2, 20], [150, 0, 40], 4, 2, 16, FP8_DTYPE, device, seed=9)
    out = prefill_attention(
        *p.kernel_args(p.tiles(capacity=12)), logit_softcap=cap, window=window,
        block_m=BLOCK_M, block_n=BLOCK_N, num_splits=splits,
    )  # fmt: skip
    ref = prefill_attention_ref(*p.ref_args(), logit_softcap=cap, window=window)
    _assert_kernel_matches_ref(out, ref, p)


def test_split_count_is_a_power_of_two(device: torch.device) -> None:
    p = _make_prefill([3], [5], 2, 1, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        prefill_attention(*p.kernel_args(p.tiles()), num_splits=3)


def test_out_buffer_is_reused_and_tokens_of_no_sequence_untouched(device: torch.device) -> None:
    p = _make_prefill([6, 5, 4], [2, 0, 9], 2, 1, 32, torch.bfloat16, device, seed=4)
    p = p._replace(qo_indptr=p.qo_indptr[:3], kv_indptr=p.kv_indptr[:3])  # the last is a pad
    out = torch.full(p.q.shape, 5.0, dtype=torch.bfloat16, device=device)
    args = p.kernel_args(p.tiles())
    assert prefill_attention(*args, out=out, block_m=BLOCK_M, block_n=BLOCK_N) is out
    _assert_kernel_matches_ref(out[:11], prefill_attention_ref(*p.ref_args())[:11], p)
    assert bool((out[11:] == 5.0).all()), "tokens of no sequence must stay as they were"


def test_tiles_cover_every_packed_row_once_longest_first() -> None:
    qo, kv = _indptr([3, 10, 1]), _indptr([3, 40, 30])
    tiles = prefill_tiles(qo, kv, group=2, block_m=8)
    # packed rows: 6 -> 1 tile, 20 -> 3 tiles (starts 0, 8, 16), 2 -> 1 tile
    assert sorted(map(tuple, tiles.tolist())) == [(0, 0), (1, 0), (1, 8), (1, 16), (2, 0)]
    # keys read: seq 1's tiles 30 + (4, 8, 10) = 34/38/40, seq 2's 30, seq 0's 3
    assert tiles.tolist() == [[1, 16], [1, 8], [1, 0], [2, 0], [0, 0]]
    padded = prefill_tiles(qo, kv, group=2, block_m=8, capacity=7)
    assert padded[5:].tolist() == [[-1, 0], [-1, 0]]
    with pytest.raises(ValueError, match="exceed the tile map's capacity 4"):
        prefill_tiles(qo, kv, group=2, block_m=8, capacity=4)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p._replace(q=p.q.float()), "q must be bf16"),
        (lambda p: p._replace(k_cache=p.k_cache.half()), "k_cache must be bf16 or"),
        (lambda p: p._replace(kv_indptr=p.kv_indptr[:2]), "qo_indptr .* differ"),
        (lambda p: p._replace(kv_indices=p.kv_indices.long()), "kv_indices must be int32"),
        (lambda p: p._replace(qo_indptr=p.qo_indptr.long()), "qo_indptr must be int32"),
        (lambda p: p._replace(kv_indptr=_indptr([2, 4])), "sequence 0 has 3 queries but only 2"),
    ],
)
def test_bad_arguments_fail_with_their_name(change, message: str) -> None:
    p = change(_make_prefill([3, 2], [4, 0], 4, 2, 16, torch.bfloat16))
    with pytest.raises(ValueError, match=message):
        prefill_attention_ref(*p.ref_args())


def test_bad_window_and_tiles_fail_with_their_name(device: torch.device) -> None:
    p = _make_prefill([3], [0], 2, 1, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="window must be None or a positive int"):
        prefill_attention_ref(*p.ref_args(), window=0)
    with pytest.raises(ValueError, match="tiles must be int32 \\[N, 2\\]"):
        prefill_attention(*p.kernel_args(p.tiles().long()))
