"""Prompt prefills over their own new K/V (`--prefill-attention fresh`, attention/fresh_prefill.py)
on the CPU: the layout, the copies, the choice of path and the whole engine, with the torch
reference's attention in place of FlashInfer's (tests/gpu runs that)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrec_core.attention import SharedPrefix, TorchAttentionBackend
from flashrec_core.attention.fresh_prefill import (
    FreshLayout,
    FreshPrefillAttention,
    FreshPrefillGraph,
    FreshPrefillPlan,
)
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.engine.prefill_graph import fits_prefill_graph, pad_prefill
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch
from flashrec_core.spec import AttentionSpec

CPU = torch.device("cpu")
HQ, HKV, D = 4, 2, 32


def _step(new=(5, 4, 3), cached=(0, 4, 5), seed: int = 0):
    """A prefill of `new` tokens after `cached` ones per prompt over scattered slots."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [n + c for n, c in zip(new, cached)]
    perm = torch.randperm(200, generator=gen) + 1  # slot 0 is the pad slot
    ends = np.cumsum([0, *lengths])
    slots = [perm[ends[i] : ends[i + 1]] for i in range(len(lengths))]
    prompts = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in lengths]
    return prepare_prefill(prompts, slots, list(cached)), slots


def test_layout_puts_each_sequences_context_then_its_own_tokens_in_slot_order() -> None:
    step, slots = _step(new=(3, 2), cached=(0, 4))
    layout = FreshLayout.of(step)
    # sequence 0: no context, rows 0-2 are its tokens; sequence 1: rows 3-6 its cached slots,
    # rows 7-8 its two new tokens (tokens 3 and 4 of the step)
    assert layout.own_rows.tolist() == [0, 1, 2, 7, 8]
    assert layout.context_rows.tolist() == [3, 4, 5, 6]
    assert layout.context_slots.tolist() == slots[1][:4].tolist()
    assert layout.num_rows == 9


def _pool(kv_dtype: torch.dtype, gen: torch.Generator) -> KVPool:
    pool = KVPool(1, HKV, D, 256, kv_dtype, CPU)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, generator=gen).to(kv_dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, generator=gen).to(kv_dtype))
    return pool


def _attend(backend, step, pool, q, new_kv, spec_scale: float = D**-0.5):
    meta = backend.plan(step)
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, backend, meta)
    return backend.forward(q, 0, spec_scale, batch, new_kv), meta


def _fresh(inner, layers=(), max_graph=(0, 0)) -> FreshPrefillAttention:
    return FreshPrefillAttention(
        inner, CPU, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
        max_graph=max_graph, layers=layers,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [AttentionSpec(scale=D**-0.5), AttentionSpec(scale=0.3, logit_softcap=1.5, sliding_window=4)],
    ids=["plain", "softcap-window"],
)
@pytest.mark.parametrize("cached", [(0, 4, 5), (0, 0, 0)], ids=["context", "no-context"])
def test_own_keys_enter_unrounded_and_the_context_as_the_cache_holds_it(spec, cached) -> None:
    """Over an FP8 pool: the fresh prefill equals the torch backend over a table whose own rows
    hold the layer's K/V unrounded and whose context rows hold the pool's values; and it is not
    the pool's own attention (the own keys' rounding shows)."""
    gen = torch.Generator().manual_seed(1)
    step, _ = _step(cached=cached)
    pool = _pool(torch.float8_e4m3fn, gen)
    tokens = step.input_ids.numel()
    k, v = (torch.randn(tokens, HKV, D, generator=gen) for _ in range(2))
    pool.k_cache[0][step.out_cache_loc] = k.to(pool.dtype)  # as the layer stores them
    pool.v_cache[0][step.out_cache_loc] = v.to(pool.dtype)
    q = torch.randn(tokens, HQ, D, generator=gen)
    torch_backend = TorchAttentionBackend(CPU, layers=(spec,))
    fresh = _fresh(torch_backend, layers=(spec,))
    got, meta = _attend(fresh, step, pool, q, (k, v), spec.scale)
    assert isinstance(meta, FreshPrefillPlan)
    assert (meta.buffers is None) == (sum(cached) == 0)
    # the expected table: the pool in fp32 with the step's own slots holding k, v unrounded
    exact = KVPool(1, HKV, D, 256, torch.float32, CPU)
    for table, src, new in ((exact.k_cache[0], pool.k_cache[0], k), (exact.v_cache[0], pool.v_cache[0], v)):  # fmt: skip
        table.copy_(src.float())
        table[step.out_cache_loc] = new
    ref, _ = _attend(torch_backend, step, exact, q, None, spec.scale)
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5)
    rounded, _ = _attend(torch_backend, step, pool, q, None, spec.scale)
    assert (rounded - got).abs().max() > 1e-2, "the own keys' FP8 rounding should show"
    assert fresh.prefills == {"with context" if sum(cached) else "fresh": 1}


def test_long_context_prefills_and_beam_steps_go_to_the_wrapped_backend() -> None:
    torch_backend = TorchAttentionBackend(CPU)
    fresh = _fresh(torch_backend)
    assert fresh.name == "torch+fresh-prefill"
    long_context, _ = _step(new=(2, 3), cached=(9, 1))  # 10 context rows, 5 new tokens
    assert not isinstance(fresh.plan(long_context), FreshPrefillPlan)
    assert fresh.prefills == {"wrapped": 1}
    # a beam step: several rows per request under its shared prompt (the two-level view)
    step, _ = _step(new=(2, 2), cached=(1, 1))
    one = torch.tensor([0, 1, 2])
    prompt = SharedPrefix(one * 2, one * 1, torch.arange(2), one * 2, torch.arange(4))
    beam = dataclasses.replace(step, shared_prefix=prompt)
    assert not isinstance(fresh.plan(beam), FreshPrefillPlan)
    assert fresh.prefills == {"wrapped": 1}, "beam steps are not prefills"


@pytest.mark.parametrize("triton_copies", [False, True], ids=["torch-copy", "triton-copy"])
def test_graph_plans_in_the_shared_buffers_give_the_eager_result(triton_copies: bool) -> None:
    """A prefill graph's plans go into the buffers every shape shares, replayed here on the
    CPU without capture: padded steps give the eager result for their real tokens. The second
    plan has less context than the first: its context entries are padded to the shape's tokens
    with the spare row, which the torch copy writes and the Triton copy (interpreted) skips,
    stopping at the count (tests/kernels/test_copy_kv_rows.py); no stale entry overwrites the
    second step's own rows."""
    gen = torch.Generator().manual_seed(5)
    pool = _pool(torch.bfloat16, gen)
    fresh = FreshPrefillAttention(
        TorchAttentionBackend(CPU), CPU, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
        dtype=torch.float32, max_graph=(32, 5), triton_copies=triton_copies,
    )  # fmt: skip
    graph = FreshPrefillGraph(num_sequences=5, max_tokens=24, per_group=())
    for new, cached in (((5, 4, 3), (0, 4, 5)), ((6, 2, 7), (4, 0, 0))):
        step, _ = _step(new, cached, seed=sum(cached))
        tokens = step.input_ids.numel()
        q = torch.randn(tokens, HQ, D, generator=gen)
        k, v = (torch.randn(tokens, HKV, D, generator=gen) for _ in range(2))
        eager, _ = _attend(_fresh(TorchAttentionBackend(CPU)), step, pool, q, (k, v))
        padded = pad_prefill(step, 24, 5)
        pad = torch.zeros(24 - tokens, HKV, D)
        q_padded = torch.cat([q, torch.zeros(24 - tokens, HQ, D)])
        meta = fresh.plan(padded, graph=graph)
        assert isinstance(meta, FreshPrefillPlan) and meta.buffers is not None
        assert (meta.context_count is not None) == triton_copies
        assert meta.context_rows.numel() == 24  # the shape's room, not the largest graph's
        batch = ForwardBatch(
            padded.input_ids, padded.positions, padded.out_cache_loc, pool, fresh, meta
        )
        got = fresh.forward(q_padded, 0, D**-0.5, batch, (torch.cat([k, pad]), torch.cat([v, pad])))
        # the torch attention batches the padded step's sequences otherwise: fp32 summation
        # order (4e-7 seen), where a wrong key row moves outputs by O(1)
        torch.testing.assert_close(got[:tokens], eager, rtol=0, atol=1e-5)


def test_a_long_context_prefill_plans_in_the_wrapped_backends_graph() -> None:
    """A prefill with more context than a fresh graph has rows for replays the wrapped
    backend's graph of its shape (`PrefillGraphs` keys it by shape and path): the graph state is
    the Triton prefill wrapper's (interpreted), the plan is its plan, the result its eager one;
    counted as wrapped. A wrapped backend without prefill graphs refuses, so the capture fails
    with a reason and the step runs eagerly."""
    pytest.importorskip("triton")
    from flashrec_core.attention.triton_prefill import PrefillKernelPlan, TritonPrefillAttention

    gen = torch.Generator().manual_seed(3)
    pool = _pool(torch.bfloat16, gen)
    triton = TritonPrefillAttention(
        TorchAttentionBackend(CPU), CPU, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
        max_context=64, max_graph=(32, 5),
    )  # fmt: skip
    fresh = _fresh(triton, max_graph=(32, 5))
    step, _ = _step(new=(3, 2, 1), cached=(0, 4, 9))  # 13 context rows, 6 new tokens
    padded = pad_prefill(step, 8, 5)
    assert not fresh.fits_prefill_graph(padded, 8)
    graph = fresh.prefill_graph_attention(5, 8, wrapped=True)
    meta = fresh.plan(padded, graph=graph)
    assert isinstance(meta, PrefillKernelPlan) and fresh.prefills == {"wrapped": 1}
    tokens = step.input_ids.numel()
    q = torch.randn(tokens, HQ, D, generator=gen).to(torch.bfloat16)
    q_padded = torch.cat([q, torch.zeros(8 - tokens, HQ, D, dtype=q.dtype)])
    batch = ForwardBatch(padded.input_ids, padded.positions, padded.out_cache_loc, pool, fresh, meta)  # fmt: skip
    got = fresh.forward(q_padded, 0, D**-0.5, batch)
    eager_meta = triton.plan(step)
    eager_batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, triton, eager_meta)  # fmt: skip
    assert torch.equal(got[:tokens], triton.forward(q, 0, D**-0.5, eager_batch))
    with pytest.raises(ValueError, match="the torch attention backend cannot capture prefills"):
        _fresh(TorchAttentionBackend(CPU)).prefill_graph_attention(5, 8, wrapped=True)


def test_a_prefill_graph_fits_as_many_context_rows_as_its_tokens() -> None:
    fresh = _fresh(TorchAttentionBackend(CPU), max_graph=(64, 5))
    step, _ = _step(new=(3, 2, 1), cached=(0, 4, 9))  # 13 context rows
    assert fresh.fits_prefill_graph(pad_prefill(step, 16, 5), 16)
    assert not fresh.fits_prefill_graph(pad_prefill(step, 12, 5), 12)
    assert fits_prefill_graph(fresh, pad_prefill(step, 16, 5), 16)
    # a backend without the check replays whatever pads to a shape
    assert fits_prefill_graph(TorchAttentionBackend(CPU), pad_prefill(step, 12, 5), 12)


def _tiny_engine(path: Path, **settings) -> Engine:
    """The demo checkpoint (a tiny Qwen3 of 3 x 16 codes) in bf16 on the CPU."""
    from flashrec_core.demo import write_demo

    if not (path / "catalog.json").exists():
        write_demo(path, "Qwen3ForCausalLM", (16, 16, 16), num_items=800, seed=1)
    cfg = EngineConfig(
        model_path=str(path), device="cpu", dtype="bfloat16", show_progress=False,
        kv_cache_tokens=4096, enable_fused_rms_fp8=False, enable_fused_silu_fp8=False,
        **settings,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(path / "catalog.json")))


def _search(engine: Engine) -> list[dict[tuple[int, ...], float]]:
    """A short prompt first, then prompts that extend it by more tokens than it has (a
    prefix-cache hit with context, through the fresh path) and a fresh one."""
    base = "user w1 w2"
    out = []
    for prompts in ([base], [f"{base} w3 w4 w5 w6 w7 item", f"{base} w9 w8 w7 w6 w5", "x y z"]):
        results = engine.generate([engine.make_request(prompt=p, n=6) for p in prompts])
        out += [{c.codes: c.logprob for c in r.choices} for r in results]
    return out


@pytest.mark.parametrize("fused_rope", [False, True], ids=["torch-rope", "fused-rope"])
def test_engine_with_fresh_prefills_equals_the_backends_over_a_bf16_cache(
    tmp_path: Path, fused_rope: bool
) -> None:
    """The whole engine in bf16 with a bf16 cache, where a prompt's fresh K/V equal what the
    cache holds: the same beams and the same log-probs as the backend's prefill, bit for bit
    (the same torch attention over the same values). With the fused RoPE kernel (interpreted)
    the keys come from the qkv buffer the kernel rotated in place, and a prefill with context
    gets its own rows from the kernel's mirror. Prefix-cache hits take the context path."""
    settings = dict(enable_fused_qk_rope_kv=fused_rope, triton_on_cpu=fused_rope)
    backend = _search(_tiny_engine(tmp_path, prefill_attention="backend", **settings))
    engine = _tiny_engine(tmp_path, prefill_attention="fresh", **settings)
    fresh = engine.runner.attn_backend
    assert isinstance(fresh, FreshPrefillAttention)
    assert _search(engine) == backend
    assert fresh.prefills["with context"] >= 1 and fresh.prefills["fresh"] >= 1
    mirrored = fresh.prefills["with context"] if fused_rope else 0
    assert fresh.prefills["mirrored"] == mirrored


def test_fresh_needs_flashinfer_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashrec_core.config as config

    monkeypatch.setattr(config, "flashinfer_available", lambda: False)
    cfg = EngineConfig(model_path="m", device="cuda", prefill_attention="fresh")
    with pytest.raises(ValueError, match="--prefill-attention fresh runs FlashInfer"):
        config._resolve_prefill_attention(cfg, 128)
