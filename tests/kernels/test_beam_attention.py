"""beam_cascade_attention: the reference against flat fp64 attention, the Triton kernel against the ref.

Tolerances. The reference computes in fp32 and rounds to bf16, so against exact fp64 attention it
is off by at most half a bf16 ulp (<= 2^-8 relative) plus fp32 summation error (~1e-6 on outputs
of magnitude ~1-3). The kernel feeds P (probabilities) to the PV dot as bf16 over a bf16 cache,
as flash attention does: each p_j moves by <= 2^-9 relative while the normalizer keeps the fp32
sum, so the fp32 output moves by <= 2^-9 * max|v|; over an FP8 cache as fp16 (<= 2^-12). Both sides then round to bf16 separately, which can split a
tie-near value by one bf16 ulp (<= 2^-7 relative). Hence kernel vs ref: rtol 2^-7, atol
2^-9 * max|v|.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, beam_cascade_attention, beam_cascade_attention_ref

NUM_SLOTS = 512
PAD = 16  # extra columns per fused qkv row, so q's row stride is not Hq * D


class Step(NamedTuple):
    """One decode step's attention inputs (all on one device)."""

    q: torch.Tensor  # [R, Hq, D] bf16
    k_cache: torch.Tensor  # [NUM_SLOTS, Hkv, D]
    v_cache: torch.Tensor
    prefix_indptr: torch.Tensor  # int32 [B + 1]
    prefix_indices: torch.Tensor  # int32 [sum of prefix lens]
    row_indptr: torch.Tensor  # int32 [B + 1]
    suffix: torch.Tensor  # int32 [R, S]
    sm_scale: float
    max_rows: int

    def args(self) -> tuple:
        return (*self[:-2], self.sm_scale, self.max_rows)


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _make_step(
    rows: list[int],
    prefix_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    s: int,
    cache_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
    strided: bool = False,
    max_rows: int | None = None,
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(rows)
    if strided:  # q as the attention layer sees it: a view of the fused qkv buffer
        buf = torch.randn(num_rows, (hq + 2 * hkv) * d + PAD, generator=gen) * 2
        q = buf.bfloat16().to(device)[:, : hq * d].view(num_rows, hq, d)
    else:
        q = (torch.randn(num_rows, hq, d, generator=gen) * 2).bfloat16().to(device)
    k_cache = (torch.randn(NUM_SLOTS, hkv, d, generator=gen) * 2).to(cache_dtype)
    v_cache = (torch.randn(NUM_SLOTS, hkv, d, generator=gen) * 2).to(cache_dtype)
    prefix_indices = torch.randint(0, NUM_SLOTS, (sum(prefix_lens),), generator=gen)
    suffix = torch.randint(0, NUM_SLOTS, (num_rows, s + strided), generator=gen).int()
    return Step(
        q,
        k_cache.to(device),
        v_cache.to(device),
        _indptr(prefix_lens).to(device),
        prefix_indices.int().to(device),
        _indptr(rows).to(device),
        suffix.to(device)[:, :s],  # a strided view when `strided`
        d**-0.5,
        max(rows) if max_rows is None else max_rows,
    )


def _flat_attention_fp64(step: Step) -> torch.Tensor:
    """Independent spec: row by row, softmax attention over its flat slot list, in fp64."""
    num_rows, hq, _ = step.q.shape
    group = hq // step.k_cache.shape[1]
    q, k, v = (t.cpu().double() for t in (step.q, step.k_cache, step.v_cache))
    out = torch.zeros(q.shape, dtype=torch.float64)
    rows, prefix = step.row_indptr.tolist(), step.prefix_indptr.tolist()
    for b in range(len(rows) - 1):
        prompt = step.prefix_indices[prefix[b] : prefix[b + 1]].tolist()
        for r in range(rows[b], rows[b + 1]):
            slots = torch.tensor(prompt + [j for j in step.suffix[r].tolist() if j >= 0])
            for h in range(hq):
                keys, values = k[slots, h // group], v[slots, h // group]  # [P + S, D]
                probs = torch.softmax(keys @ q[r, h] * step.sm_scale, dim=0)
                out[r, h] = probs @ values
    return out


def _assert_kernel_matches_ref(out: torch.Tensor, ref: torch.Tensor, step: Step) -> None:
    v_max = float(step.v_cache.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-9 * v_max)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("hq, hkv, s", [(2, 2, 1), (4, 2, 2), (8, 2, 3)])
def test_ref_matches_flat_fp64_attention(
    cache_dtype: torch.dtype, hq: int, hkv: int, s: int
) -> None:
    step = _make_step([3, 1, 4], [5, 1, 9], hq, hkv, 16, s, cache_dtype, seed=hq + s)
    ref = beam_cascade_attention_ref(*step.args())
    assert ref.dtype == torch.bfloat16 and ref.shape == step.q.shape
    torch.testing.assert_close(
        ref.cpu().double(), _flat_attention_fp64(step), rtol=2**-8, atol=1e-5
    )


# (rows per request, prefix lens, Hq, Hkv, D, S): groups 1/2/4, D 64/128, a 1-row request,
# prefix lens 1 and non-multiples of BLOCK_N, requests spanning several BLOCK_N chunks.
KERNEL_CASES = [
    ([3, 1, 5], [70, 1, 37], 2, 2, 64, 1),
    ([1, 4, 2], [1, 130, 64], 4, 2, 128, 2),
    ([2, 6, 1, 3], [17, 1, 65, 200], 8, 2, 64, 3),
    # prompts of 8 and 5 of the unsplit launch's 128-slot chunks: the 5-stage pipeline's steady
    # state (`unsplit_stages`), past its prologue, on a GPU
    ([2, 3], [1000, 517], 4, 2, 128, 2),
]


# None: the launch's own split count (on a GPU these small grids split); 1: one program per
# tile, as a full grid launches
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"hq{c[2]}-hkv{c[3]}-d{c[4]}-s{c[5]}")
def test_kernel_matches_ref(
    case: tuple, cache_dtype: torch.dtype, splits: int | None, device: torch.device
) -> None:
    rows, prefix_lens, hq, hkv, d, s = case
    step = _make_step(rows, prefix_lens, hq, hkv, d, s, cache_dtype, device, seed=len(rows))
    out = beam_cascade_attention(*step.args(), num_splits=splits)
    _assert_kernel_matches_ref(out, beam_cascade_attention_ref(*step.args()), step)


def test_strided_q_and_suffix_views(device: torch.device) -> None:
    step = _make_step([2, 3], [40, 9], 4, 2, 64, 2, FP8_DTYPE, device, seed=3, strided=True)
    assert not step.q.is_contiguous() and not step.suffix.is_contiguous()
    out = beam_cascade_attention(*step.args())
    _assert_kernel_matches_ref(out, beam_cascade_attention_ref(*step.args()), step)


def test_duplicated_slots_count_once_per_occurrence(device: torch.device) -> None:
    step = _make_step([3, 2], [6, 4], 4, 2, 64, 3, torch.bfloat16, device, seed=4)
    # Request 0 repeats slot 7 three times, request 1 its own first slot; row 0's suffix repeats
    # a prompt slot and itself: each occurrence is one more term of the softmax.
    step.prefix_indices[:3] = 7
    step.prefix_indices[7] = step.prefix_indices[6]
    step.suffix[0] = torch.tensor([7, 7, 11], dtype=torch.int32, device=device)
    ref = beam_cascade_attention_ref(*step.args())
    torch.testing.assert_close(
        ref.cpu().double(), _flat_attention_fp64(step), rtol=2**-8, atol=1e-5
    )
    _assert_kernel_matches_ref(beam_cascade_attention(*step.args()), ref, step)


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_scores_match_the_ref_on_fp8_rounded_queries(
    splits: int, device: torch.device, fp8_exact_queries: Callable
) -> None:
    """The experimental launch with the prompt's score dot on FP8 operands equals the reference
    given the queries it rounds, the own slots included (the dot of e4m3 codes is exact in
    fp32, the row scale applied after: the bf16-query kernel's tolerance; the queries from
    `fp8_exact_queries`)."""
    from flashrec_kernels.triton_beam_attention import launch_beam_cascade_attention

    step = _make_step([3, 1, 5], [70, 1, 37], 4, 2, 64, 2, FP8_DTYPE, device, seed=5)
    q, rounded = fp8_exact_queries(step.q)
    step = step._replace(q=q)
    out = torch.empty_like(step.q)
    launch_beam_cascade_attention(
        *step.args(), out, block_m=4, block_n=16, num_splits=splits, fp8_scores=True
    )
    _assert_kernel_matches_ref(
        out, beam_cascade_attention_ref(*step._replace(q=rounded).args()), step
    )
    bf16 = _make_step([2], [5], 2, 1, 16, 1, torch.bfloat16, device)
    with pytest.raises(ValueError, match="fp8_scores needs an FP8 key cache"):
        launch_beam_cascade_attention(*bf16.args(), torch.empty_like(bf16.q), fp8_scores=True)


@pytest.mark.parametrize("splits", [1, 4])
def test_negative_suffix_entries_are_no_slot(splits: int, device: torch.device) -> None:
    """A merged step's rows of shallower waves pad their own slots with -1: rows with 1, 2 and
    3 real own slots in one launch equal attention over their real slots only (each request's
    rows share one own-slot count, as waves never split a request)."""
    from flashrec_kernels.triton_beam_attention import launch_beam_cascade_attention

    step = _make_step([3, 2, 4], [20, 5, 33], 4, 2, 64, 3, FP8_DTYPE, device, seed=12)
    step.suffix[:3, 1:] = -1  # request 0: level 1 (its own slot only)
    step.suffix[3:5, 2:] = -1  # request 1: level 2
    ref = beam_cascade_attention_ref(*step.args())
    torch.testing.assert_close(
        ref.cpu().double(), _flat_attention_fp64(step), rtol=2**-8, atol=1e-5
    )
    out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
    launch_beam_cascade_attention(*step.args(), out, block_m=4, block_n=16, num_splits=splits)
    _assert_kernel_matches_ref(out, ref, step)


def test_small_tiles_cover_many_tiles_chunks_and_idle_programs(device: torch.device) -> None:
    from flashrec_kernels.triton_beam_attention import launch_beam_cascade_attention

    # max_rows 9 x group 2 = 18 packed rows -> 5 tiles of 4: request 1 (2 rows) idles 4 of them.
    step = _make_step([9, 2, 5], [50, 3, 16], 4, 2, 64, 2, FP8_DTYPE, device, seed=5)
    out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
    launch_beam_cascade_attention(*step.args(), out, block_m=4, block_n=16)
    _assert_kernel_matches_ref(out, beam_cascade_attention_ref(*step.args()), step)


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_split_prompts_merge_to_the_ref(splits: int, device: torch.device) -> None:
    """Split-KV: prompts of 1 slot (every split but the first empty), fewer chunks than splits,
    and several chunks per split, with several tiles per request and an idle tile."""
    from flashrec_kernels.triton_beam_attention import launch_beam_cascade_attention

    step = _make_step([5, 1, 3], [1, 40, 150], 4, 2, 64, 2, FP8_DTYPE, device, seed=10)
    out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
    launch_beam_cascade_attention(*step.args(), out, block_m=4, block_n=16, num_splits=splits)
    _assert_kernel_matches_ref(out, beam_cascade_attention_ref(*step.args()), step)


def test_split_count_follows_the_grid(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    from flashrec_kernels import triton_beam_attention as kernel

    assert kernel.auto_num_splits(8, torch.device("cpu")) == 1  # the interpreter: no split
    monkeypatch.setattr(kernel, "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    # one 50-beam request (8 kv heads x 1 tile) -> 16; 512 beams (8 x 8 tiles) -> 2; 16
    # requests of 50 -> 1 (the grid fills the SMs alone)
    assert [kernel.auto_num_splits(p, cuda) for p in (1, 8, 64, 128, 300)] == [16, 16, 2, 1, 1]
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        step = _make_step([1], [3], 2, 1, 64, 1, torch.bfloat16, device)
        beam_cascade_attention(*step.args(), num_splits=3)


def test_out_buffer_is_reused_and_rows_past_the_requests_untouched(device: torch.device) -> None:
    step = _make_step([2, 3, 4], [5, 8, 3], 2, 1, 64, 1, torch.bfloat16, device, seed=6)
    step = step._replace(row_indptr=step.row_indptr[:3], prefix_indptr=step.prefix_indptr[:3])
    out = torch.full(step.q.shape, 5.0, dtype=torch.bfloat16, device=device)
    assert beam_cascade_attention(*step.args(), out=out) is out
    _assert_kernel_matches_ref(out[:5], beam_cascade_attention_ref(*step.args())[:5], step)
    assert bool((out[5:] == 5.0).all()), "rows of no request must stay as they were"


def test_static_grid_bound_exceeds_rows(device: torch.device) -> None:
    # A graph captured for 70 rows per request replays a step whose requests have 1..3 rows.
    step = _make_step([3, 1], [12, 66], 4, 2, 64, 1, torch.bfloat16, device, seed=7, max_rows=70)
    out = beam_cascade_attention(*step.args())
    _assert_kernel_matches_ref(out, beam_cascade_attention_ref(*step.args()), step)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda st: st._replace(q=st.q.float()), "q must be bf16"),
        (lambda st: st._replace(k_cache=st.k_cache.half()), "k_cache must be bf16 or"),
        (lambda st: st._replace(v_cache=st.v_cache[:, :, :32]), "v_cache must be"),
        (lambda st: st._replace(suffix=st.suffix.long()), "suffix must be int32"),
        (lambda st: st._replace(suffix=st.suffix[:2]), "suffix must be"),
        (lambda st: st._replace(prefix_indptr=st.prefix_indptr[:2]), "disagree on B"),
        (lambda st: st._replace(max_rows=0), "max_rows_per_request"),
        (lambda st: st._replace(q=torch.zeros(3, 3, 64, dtype=torch.bfloat16)), "multiple of"),
        (lambda st: st._replace(q=torch.zeros(3, 2, 48, dtype=torch.bfloat16)), "power of two"),
    ],
)
def test_bad_arguments_fail_with_their_name(change, message: str) -> None:
    step = change(_make_step([1, 2], [3, 4], 4, 2, 64, 1, torch.bfloat16))
    with pytest.raises(ValueError, match=message):
        beam_cascade_attention_ref(*step.args())


SOFTCAP = 2.0
"""Small enough that the cap bends most scores (|s| reaches ~8 here); Gemma 2's 50 barely would."""


def _flat_softcapped_fp64(step: Step, cap: float) -> torch.Tensor:
    """Independent spec of the soft-capped kernel: flat attention over cap * tanh(s / cap)."""
    num_rows, hq, _ = step.q.shape
    group = hq // step.k_cache.shape[1]
    q, k, v = (t.cpu().double() for t in (step.q, step.k_cache, step.v_cache))
    out = torch.zeros(q.shape, dtype=torch.float64)
    rows, prefix = step.row_indptr.tolist(), step.prefix_indptr.tolist()
    for b in range(len(rows) - 1):
        prompt = step.prefix_indices[prefix[b] : prefix[b + 1]].tolist()
        for r in range(rows[b], rows[b + 1]):
            slots = torch.tensor(prompt + [j for j in step.suffix[r].tolist() if j >= 0])
            for h in range(hq):
                scores = k[slots, h // group] @ q[r, h] * step.sm_scale
                probs = torch.softmax(cap * torch.tanh(scores / cap), dim=0)
                out[r, h] = probs @ v[slots, h // group]
    return out


def test_softcapped_ref_matches_flat_fp64_attention() -> None:
    step = _make_step([3, 1, 4], [5, 1, 9], 4, 2, 16, 2, torch.bfloat16, seed=8)
    ref = beam_cascade_attention_ref(*step.args(), logit_softcap=SOFTCAP)
    exact = _flat_softcapped_fp64(step, SOFTCAP)
    torch.testing.assert_close(ref.cpu().double(), exact, rtol=2**-8, atol=1e-5)
    plain = beam_cascade_attention_ref(*step.args())
    assert (plain.float() - ref.float()).abs().max() > 0.05, "the cap changed nothing"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_softcapped_kernel_matches_ref(cache_dtype: torch.dtype, device: torch.device) -> None:
    # tanh as 1 - 2 / (1 + exp(2x)) loses ~1e-7 absolute near 0, x cap: far below the bf16 ulp
    step = _make_step([2, 6, 1], [17, 70, 3], 8, 2, 64, 2, cache_dtype, device, seed=9)
    out = beam_cascade_attention(*step.args(), logit_softcap=SOFTCAP)
    ref = beam_cascade_attention_ref(*step.args(), logit_softcap=SOFTCAP)
    _assert_kernel_matches_ref(out, ref, step)


def test_softcap_must_be_positive() -> None:
    step = _make_step([1, 2], [3, 4], 4, 2, 64, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="logit_softcap must be None or > 0"):
        beam_cascade_attention_ref(*step.args(), logit_softcap=0.0)
