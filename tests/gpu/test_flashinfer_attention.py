"""FlashInfer (prefill, flat decode, cascade) == the torch reference backend, on CUDA."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.attention import TorchAttentionBackend
from flashrec_core.engine.beam_wave import prepare_beam_decode
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch
from flashrec_core.spec import AttentionSpec

pytestmark = pytest.mark.gpu

HQ, HKV, D = 16, 8, 128


def _pool(dtype: torch.dtype, slots: int = 8192) -> KVPool:
    pool = KVPool(1, HKV, D, slots, dtype, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, generator=g, device="cuda").to(dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, generator=g, device="cuda").to(dtype))
    return pool


def _strided_q(tokens: int) -> torch.Tensor:
    """q as the models pass it: the q part of a fused [T, (Hq + 2 Hkv) * D] qkv projection."""
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    return qkv[:, : HQ * D].view(tokens, HQ, D)


def _run(backend, step, pool, q, scale: float = D**-0.5) -> torch.Tensor:
    meta = backend.plan(step)
    batch = ForwardBatch(
        step.input_ids.cuda(), step.positions.cuda(), step.out_cache_loc.cuda(), pool, backend, meta
    )
    return backend.forward(q, 0, scale, batch).float()


def _flashinfer(kv_dtype: torch.dtype, cascade: bool, layers: tuple = ()):
    from flashrec_core.attention.flashinfer import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        torch.device("cuda"), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
        q_dtype=torch.bfloat16, kv_dtype=kv_dtype, cascade=cascade, layers=layers,
    )  # fmt: skip


# bf16 inputs, fp32 accumulation in both: outputs are convex combinations of V rows (|v| ~ 3),
# rounded to bf16 (2^-9 relative) by FlashInfer: 2e-2 absolute covers rounding + summation order.
ATOL = 2e-2


@pytest.mark.parametrize("cached", [False, True], ids=["full", "cached-prefix"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_prefill_matches_reference(kv_dtype: torch.dtype, cached: bool) -> None:
    """Prompts with a cached prefix have fewer queries than keys (causal from the bottom right);
    a prompt of which all but the last token is cached plans as one query per sequence."""
    pool = _pool(kv_dtype)
    lens = [37, 300, 5, 128]
    prefix_lens = [30, 64, 4, 127] if cached else None
    slots, start = [], 1
    for n in lens:
        slots.append(torch.arange(start, start + n))
        start += n + 11  # gaps: slots need not be contiguous
    step = prepare_prefill([[1] * n for n in lens], slots, prefix_lens)
    q = _strided_q(step.input_ids.numel())
    ref = _run(TorchAttentionBackend(torch.device("cuda")), step, pool, q)
    got = _run(_flashinfer(kv_dtype, cascade=True), step, pool, q)
    assert (got - ref).abs().max().item() < ATOL


def test_prefill_of_last_tokens_only_matches_reference() -> None:
    """Every prompt cached but its last token: one query per sequence, over all its slots."""
    pool = _pool(torch.bfloat16)
    lens = [9, 40, 3]
    slots = [torch.arange(1 + 50 * i, 1 + 50 * i + n) for i, n in enumerate(lens)]
    step = prepare_prefill([[1] * n for n in lens], slots, [n - 1 for n in lens])
    q = _strided_q(len(lens))
    ref = _run(TorchAttentionBackend(torch.device("cuda")), step, pool, q)
    got = _run(_flashinfer(torch.bfloat16, cascade=True), step, pool, q)
    assert (got - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("cascade", [False, True], ids=["flat", "cascade"])
def test_beam_decode_matches_reference(kv_dtype: torch.dtype, cascade: bool) -> None:
    pool = _pool(kv_dtype)
    widths, prompt_lens, level = [8, 3, 16], [200, 64, 513], 2
    prompt_slots, start = [], 1
    for n in prompt_lens:
        prompt_slots.append(torch.arange(start, start + n))
        start += n
    rows = sum(widths)
    row_request = torch.repeat_interleave(torch.arange(3), torch.tensor(widths))
    history = torch.arange(start, start + rows * level).view(rows, level)
    own = torch.arange(start + rows * level, start + rows * (level + 1))
    step = prepare_beam_decode(
        tokens=torch.ones(rows, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        prompts=torch.cat(prompt_slots).cuda(), prompt_lens=torch.tensor(prompt_lens),
        row_request=row_request, history=history.cuda(), own=own.cuda(),
    )  # fmt: skip
    q = _strided_q(rows)
    ref = _run(TorchAttentionBackend(torch.device("cuda")), step, pool, q)
    backend = _flashinfer(kv_dtype, cascade)
    got = _run(backend, step, pool, q)
    assert backend.plan(step).per_group[0].kind == ("cascade" if cascade else "decode")
    assert (got - ref).abs().max().item() < ATOL


SPECS = {
    "softcap": AttentionSpec(scale=0.1, logit_softcap=2.0),
    "window": AttentionSpec(scale=D**-0.5, sliding_window=48),
    "softcap-window": AttentionSpec(scale=0.1, logit_softcap=2.0, sliding_window=48),
}


def _beam_step(widths: list[int], prompt_lens: list[int], level: int):
    start, prompt_slots = 1, []
    for n in prompt_lens:
        prompt_slots.append(torch.arange(start, start + n))
        start += n
    rows = sum(widths)
    row_request = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
    history = torch.arange(start, start + rows * level).view(rows, level)
    own = torch.arange(start + rows * level, start + rows * (level + 1))
    return prepare_beam_decode(
        tokens=torch.ones(rows, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        prompts=torch.cat(prompt_slots).cuda(), prompt_lens=torch.tensor(prompt_lens),
        row_request=row_request, history=history.cuda(), own=own.cuda(),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(
    "path", ["prefill", "triton-prefill", "flat-decode", "cascade", "triton-beam"]
)
def test_layer_spec_honoured_like_the_reference(name: str, path: str) -> None:
    """Contract v2: soft-cap and sliding window (prompts of 30..513 tokens, window 48) through
    each FlashInfer path and the Triton beam and prefill kernels == the torch reference with
    the same spec."""
    from flashrec_core.attention.triton_beam import TritonBeamAttention
    from flashrec_core.attention.triton_prefill import TritonPrefillAttention

    spec = SPECS[name]
    pool = _pool(torch.bfloat16)
    if path.endswith("prefill"):
        lens = [30, 300, 129]
        slots = [torch.arange(1 + 600 * i, 1 + 600 * i + n) for i, n in enumerate(lens)]
        step = prepare_prefill([[1] * n for n in lens], slots, [0, 64, 100])
    else:
        step = _beam_step([8, 3, 16], [200, 30, 513], level=2)
    q = _strided_q(step.input_ids.numel())
    ref = _run(
        TorchAttentionBackend(torch.device("cuda"), layers=(spec,)), step, pool, q, spec.scale
    )
    backend = _flashinfer(torch.bfloat16, cascade=path != "flat-decode", layers=(spec,))
    if path == "triton-beam":
        backend = TritonBeamAttention(
            backend, torch.device("cuda"), 64, 4096, layers=(spec,), head_dim=D
        )
    if path == "triton-prefill":
        backend = TritonPrefillAttention(
            backend, torch.device("cuda"), num_q_heads=HQ, num_kv_heads=HKV,
            head_dim=D, max_context=1024, layers=(spec,),
        )  # fmt: skip
    got = _run(backend, step, pool, q, spec.scale)
    err = (got - ref).abs().max().item()
    assert err < ATOL, f"{path} with {name} ({spec}): max abs diff {err:.4f} vs the torch reference"
