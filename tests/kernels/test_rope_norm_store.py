"""rope_norm_store: the reference against complex rotation, the Triton kernel against the ref."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from flashrec_kernels import FP8_DTYPE, rope_norm_store, rope_norm_store_ref
from flashrec_kernels.testing import assert_ulp_close

EPS = 1e-6
NUM_SLOTS = 24
PAD = 16  # extra columns per qkv row, so the row stride is not (Hq + 2 Hkv) * D


class Qkv(NamedTuple):
    buf: torch.Tensor  # [T, (Hq + 2 Hkv) * D + PAD]
    q: torch.Tensor  # [T, Hq, D] views into buf
    k: torch.Tensor
    v: torch.Tensor


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # [max_pos, r]: cos | sin


def _qkv_views(buf: torch.Tensor, hq: int, hkv: int, d: int) -> Qkv:
    """Zero-copy per-head views of a fused qkv buffer, as the attention layer makes them."""
    t = buf.shape[0]
    q = buf[:, : hq * d].view(t, hq, d)
    k = buf[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = buf[:, (hq + hkv) * d : (hq + 2 * hkv) * d].view(t, hkv, d)
    return Qkv(buf, q, k, v)


def _make_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> Qkv:
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(t, (hq + 2 * hkv) * d + PAD, generator=gen) * 2).to(dtype)
    return _qkv_views(buf, hq, hkv, d)


def test_ref_matches_complex_rotation_and_rms_norm() -> None:
    t, hq, hkv, d, r = 3, 2, 1, 16, 8
    x = _make_qkv(t, hq, hkv, d, torch.float32, seed=0)
    original = x.buf.clone()
    gen = torch.Generator().manual_seed(1)
    q_w, k_w = 1 + torch.randn(d, generator=gen), 1 + torch.randn(d, generator=gen)
    positions, out_loc = torch.tensor([0, 5, 17]), torch.tensor([9, 2, 4])
    k_cache, v_cache = torch.zeros(NUM_SLOTS, hkv, d), torch.zeros(NUM_SLOTS, hkv, d)
    rope_norm_store_ref(
        x.q, x.k, x.v, positions, _cos_sin_cache(32, r), k_cache, v_cache, out_loc, q_w, k_w, EPS
    )
    inv_freq = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    turn = torch.polar(
        torch.ones(t, 1, r // 2, dtype=torch.float64), positions[:, None, None] * inv_freq
    )
    before = _qkv_views(original, hq, hkv, d)
    for got, src, w in ((x.q, before.q, q_w), (x.k, before.k, k_w)):
        normed = F.rms_norm(src.double(), (d,), w.double(), EPS)
        z = torch.complex(normed[..., : r // 2], normed[..., r // 2 : r]) * turn
        expected = torch.cat([z.real, z.imag, normed[..., r:]], dim=-1)
        # fp32 math against fp64 truth, |values| <~ 10: a few fp32 ulps.
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache[out_loc], x.k) and torch.equal(v_cache[out_loc], before.v)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[out_loc] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    assert torch.equal(x.buf[:, -PAD:], original[:, -PAD:]) and torch.equal(x.v, before.v)


def test_ref_without_norm_leaves_pass_through_dims_untouched() -> None:
    x = _make_qkv(4, 2, 1, 32, torch.bfloat16, seed=2)
    original = x.buf.clone()
    caches = torch.zeros(2, NUM_SLOTS, 1, 32, dtype=torch.bfloat16)
    positions, out_loc = torch.arange(4), torch.arange(4)
    rope_norm_store_ref(x.q, x.k, x.v, positions, _cos_sin_cache(8, 16), *caches, out_loc)
    before = _qkv_views(original, 2, 1, 32)
    assert torch.equal(x.q[..., 16:], before.q[..., 16:])
    assert torch.equal(x.q[0], before.q[0])  # position 0: cos 1, sin 0, no norm -> identity


CASES = {
    # name: (dtype, cache dtype, head_dim, rotary_dim, q norm, k norm)
    "fp32-full-nonorm": (torch.float32, torch.float32, 64, 64, False, False),
    "fp32-partial-norm-fp8cache": (torch.float32, FP8_DTYPE, 64, 32, True, True),
    "bf16-full-norm": (torch.bfloat16, torch.bfloat16, 64, 64, True, True),
    "bf16-partial-nonorm-fp8cache": (torch.bfloat16, FP8_DTYPE, 64, 32, False, False),
    "bf16-partial-norm-fp8cache": (torch.bfloat16, FP8_DTYPE, 64, 16, True, True),
    "bf16-d80-r40-norm": (torch.bfloat16, torch.bfloat16, 80, 40, True, True),
    "bf16-qnorm-only": (torch.bfloat16, torch.bfloat16, 64, 64, True, False),
    "fp16-full-norm-fp32cache": (torch.float16, torch.float32, 64, 64, True, True),
}


_REL_ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _assert_rope_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel vs ref: one rounding of the output dtype apart, or a few fp32 ulps absolute.

    inv_rms may differ by an fp32 ulp (reduction order) and GPUs fuse x1*cos - x2*sin into FMAs,
    so the fp32 values differ by a few ulps of the inputs' magnitude (|x| < 8: 2^-18 absolute).
    That flips at most one rounding to the output dtype (the relative term), except where the
    rotation cancels to near zero, where it is many output ulps but still tiny (the absolute term).
    """
    if actual.dtype == FP8_DTYPE:  # e4m3 steps are >= 2^-9, far above fp32 noise: one code
        assert_ulp_close(actual, expected, max_ulp=1, max_frac=0.01)
    else:
        torch.testing.assert_close(actual, expected, rtol=_REL_ULP[actual.dtype], atol=2**-18)


def _check_kernel_against_ref(
    device: torch.device, case: tuple, hq: int, hkv: int, strided_indices: bool = False,
    kernel: Callable[..., None] = rope_norm_store,
) -> None:  # fmt: skip
    dtype, cache_dtype, d, r, q_norm, k_norm = case
    gen = torch.Generator().manual_seed(3)
    q_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(device) if q_norm else None
    k_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(device) if k_norm else None
    positions = torch.tensor([0, 3, 100, 7], device=device)
    out_loc = torch.tensor([5, 0, 23, 11], device=device)
    if strided_indices:  # columns of a [T, 3] table, like a beam step's slots of one level
        positions = torch.stack([positions, positions + 1, positions + 2], dim=1)[:, 0]
        out_loc = torch.stack([out_loc + 1, out_loc, out_loc + 2], dim=1)[:, 1]
        assert positions.stride(0) == 3 and out_loc.stride(0) == 3
    cos_sin = _cos_sin_cache(128, r).to(device)
    results = []
    for fn in (kernel, rope_norm_store_ref):
        x = _make_qkv(len(positions), hq, hkv, d, dtype, seed=4)
        x = _qkv_views(x.buf.to(device), hq, hkv, d)
        caches = torch.zeros(2, NUM_SLOTS, hkv, d, device=device).to(cache_dtype)
        fn(x.q, x.k, x.v, positions, cos_sin, caches[0], caches[1], out_loc, q_w, k_w, EPS, r)
        results.append((x.buf, caches))
    (buf, caches), (buf_ref, caches_ref) = results
    _assert_rope_close(buf, buf_ref)  # q and k in place; v and the padding untouched
    _assert_rope_close(caches[0], caches_ref[0])
    assert_ulp_close(caches[1], caches_ref[1], max_ulp=0)  # v is a plain cast: exact


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_ref(device: torch.device, case: str) -> None:
    _check_kernel_against_ref(device, CASES[case], hq=4, hkv=2)  # GQA


@pytest.mark.parametrize(
    ("hq", "hkv"), [(20, 4), (20, 20), (1, 1)], ids=["gqa-2qblocks", "mha-2blocks", "one"]
)
def test_kernel_head_blocks(device: torch.device, hq: int, hkv: int) -> None:
    """A program rotates up to 16 heads: several blocks, a partial last block, a single head."""
    case = (torch.bfloat16, FP8_DTYPE, 32, 16, True, True)
    _check_kernel_against_ref(device, case, hq=hq, hkv=hkv)


@pytest.mark.parametrize(("tokens", "warps"), [(2, None), (4, 8), (8, 4)])
def test_kernel_token_blocks(device: torch.device, tokens: int, warps: int | None) -> None:
    """Launch configurations of several tokens per program (scripts/bench_elementwise.py) give
    the reference's result; 8 tokens per program over 4 tokens masks half of its rows, and
    20 q heads (two head blocks, the last partial) mask heads within each token."""
    from flashrec_kernels.triton_rope import launch_rope_norm_store

    def launch(q, k, v, positions, cos_sin, k_cache, v_cache, out_loc, q_w, k_w, eps, r):
        launch_rope_norm_store(
            q, k, v, positions, cos_sin, k_cache, v_cache, out_loc, (q_w, k_w), eps, r,
            tokens_per_program=tokens, num_warps=warps,
        )  # fmt: skip

    case = (torch.bfloat16, FP8_DTYPE, 64, 32, True, True)
    _check_kernel_against_ref(device, case, hq=20, hkv=4, strided_indices=True, kernel=launch)


def test_default_launch_at_the_bench_shape(device: torch.device) -> None:
    """16 q / 8 KV heads of 128 (Qwen3-1.7B): the default launch below SMALL_LAUNCH_TOKENS takes
    two tokens a program; 4 tokens (two full blocks) and the strided indices of a beam step."""
    from flashrec_kernels.triton_rope import default_launch

    assert default_launch(4, 16 * 128) == (2, 16)
    case = (torch.bfloat16, FP8_DTYPE, 128, 128, True, True)
    _check_kernel_against_ref(device, case, hq=16, hkv=8, strided_indices=True)


def test_kernel_strided_positions_and_slots(device: torch.device) -> None:
    """Eager beam steps pass a level's column of the [R, depth] slot table as out_loc: the
    kernel must follow its stride (reading it as contiguous stored K/V into other beams' slots;
    found on the H200, where graph replays copied the column into a contiguous buffer first)."""
    case = (torch.bfloat16, FP8_DTYPE, 64, 64, True, True)
    _check_kernel_against_ref(device, case, hq=4, hkv=2, strided_indices=True)


def test_kernel_empty_batch(device: torch.device) -> None:
    x = _qkv_views(torch.empty(0, 4 * 64, device=device), 2, 1, 64)
    caches = torch.zeros(2, NUM_SLOTS, 1, 64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    cos_sin = _cos_sin_cache(8, 64).to(device)
    rope_norm_store(x.q, x.k, x.v, empty, cos_sin, caches[0], caches[1], empty)
    assert not caches.any()


def test_rejects_bad_arguments() -> None:
    x = _make_qkv(2, 2, 1, 16, torch.float32, seed=5)
    caches = torch.zeros(2, NUM_SLOTS, 1, 16)
    idx = torch.arange(2)
    with pytest.raises(ValueError, match="rotary_dim=8 but cos_sin_cache has 16"):
        rope_norm_store_ref(x.q, x.k, x.v, idx, _cos_sin_cache(4, 16), *caches, idx, rotary_dim=8)
    with pytest.raises(ValueError, match="k_cache must be"):
        rope_norm_store_ref(
            x.q, x.k, x.v, idx, _cos_sin_cache(4, 16), caches[0, :, :, :8], caches[1], idx
        )
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        rope_norm_store_ref(
            x.q, x.k, x.v, idx, _cos_sin_cache(4, 16), *caches, idx, q_norm_weight=torch.ones(8)
        )
    with pytest.raises(ValueError, match="positions must be"):
        rope_norm_store_ref(x.q, x.k, x.v, idx.float(), _cos_sin_cache(4, 16), *caches, idx)
    mirror = (torch.zeros(4, 1, 16, dtype=torch.bfloat16), torch.zeros(4, 1, 16), idx)
    with pytest.raises(ValueError, match=r"mirror k_out must be \[rows, 1, 16\] in torch.float32"):
        rope_norm_store_ref(x.q, x.k, x.v, idx, _cos_sin_cache(4, 16), *caches, idx, mirror=mirror)
    mirror = (torch.zeros(4, 1, 16), torch.zeros(4, 1, 16), torch.arange(3))
    with pytest.raises(ValueError, match=r"mirror rows must be int64/int32 \[2\]"):
        rope_norm_store(x.q, x.k, x.v, idx, _cos_sin_cache(4, 16), *caches, idx, mirror=mirror)


@pytest.mark.parametrize("tokens", [1, 2], ids=["one-token", "two-tokens"])
def test_kernel_mirror(device: torch.device, tokens: int) -> None:
    """With a mirror, token i's k (as rotated in place) and v also land in row rows[i] of two
    buffers in k's dtype, exact copies; the other rows stay as they were. One token a program
    (scalar row index) and two (per-row indices, the last program half masked)."""
    from flashrec_kernels.triton_rope import launch_rope_norm_store

    hq, hkv, d, t = 4, 2, 64, 5
    gen = torch.Generator().manual_seed(6)
    k_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
    positions = torch.tensor([0, 3, 100, 7, 9], device=device)
    out_loc = torch.tensor([5, 0, 23, 11, 2], device=device)
    rows = torch.tensor([6, 1, 2, 9, 4], device=device)  # 10 rows: 0, 3, 5, 7, 8 untouched
    cos_sin = _cos_sin_cache(128, d).to(device)
    x = _make_qkv(t, hq, hkv, d, torch.bfloat16, seed=7)
    x = _qkv_views(x.buf.to(device), hq, hkv, d)
    v_before = x.v.clone()
    caches = torch.zeros(2, NUM_SLOTS, hkv, d, device=device).to(FP8_DTYPE)
    sentinel = torch.full((2, 10, hkv, d), 7.0, dtype=torch.bfloat16, device=device)
    mirror = (sentinel[0].clone(), sentinel[1].clone(), rows)
    launch_rope_norm_store(
        x.q, x.k, x.v, positions, cos_sin, caches[0], caches[1], out_loc, (None, k_w), EPS, d,
        tokens_per_program=tokens, mirror=mirror,
    )  # fmt: skip
    k_out, v_out, _ = mirror
    assert torch.equal(k_out[rows], x.k) and torch.equal(v_out[rows], v_before)
    untouched = torch.ones(10, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(k_out[untouched], sentinel[0][untouched])
    assert torch.equal(v_out[untouched], sentinel[1][untouched])
    # the reference writes the same mirror
    y = _qkv_views(_make_qkv(t, hq, hkv, d, torch.bfloat16, seed=7).buf.to(device), hq, hkv, d)
    ref = (sentinel[0].clone(), sentinel[1].clone(), rows)
    ref_caches = torch.zeros_like(caches)
    rope_norm_store_ref(
        y.q, y.k, y.v, positions, cos_sin, ref_caches[0], ref_caches[1], out_loc, None, k_w,
        EPS, d, mirror=ref,
    )  # fmt: skip
    _assert_rope_close(ref[0], k_out)
    assert torch.equal(ref[1], v_out)
