"""Prompt prefills through the Triton prefill kernel (interpreted on CPU) vs the torch backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.attention import TorchAttentionBackend
from flashrec_core.attention.triton_beam import TritonBeamAttention
from flashrec_core.attention.triton_prefill import (
    PrefillKernelGraph,
    PrefillKernelPlan,
    TritonPrefillAttention,
)
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import prepare_beam_decode
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.engine.prefill_graph import pad_prefill
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch
from flashrec_core.registry import Registry
from flashrec_core.spec import AttentionSpec
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_searches_alike

pytest.importorskip("triton")
CPU = torch.device("cpu")
HQ, HKV, D = 4, 2, 32
# Both paths: fp32 softmax over the same slots; the kernel feeds P to the PV dot as bf16 and
# rounds its output to bf16 (2^-9 relative on values |v| <= ~4), summing in another order:
# 2e-2 absolute covers both (as for the beam kernel, tests/core/test_triton_beam_attention.py).
ATOL = 2e-2
BEAM_TOL = 0.05
"""Per-beam log-prob gap between two engines: a prefill and three steps of bf16 attention noise."""


def _prefill(kv_dtype: torch.dtype, new: tuple[int, ...] = (9, 1, 30), cached=(0, 5, 12)):
    """A prefill of `new` tokens after `cached` ones per prompt, over a random pool, and q as
    the attention layer sees it (a strided view of the fused qkv output)."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, HKV, D, 256, kv_dtype, CPU)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, generator=gen).to(kv_dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, generator=gen).to(kv_dtype))
    lengths = [n + c for n, c in zip(new, cached)]
    perm = torch.randperm(255, generator=gen) + 1  # slot 0 is the pad slot
    offsets = torch.tensor([0, *lengths]).cumsum(0).tolist()
    slots = [perm[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    prompts = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in lengths]
    step = prepare_prefill(prompts, slots, list(cached))
    tokens = step.input_ids.numel()
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    return pool, step, qkv[:, : HQ * D].view(tokens, HQ, D)


def _attend(backend, step, pool, q, scale: float = D**-0.5, graph=None) -> torch.Tensor:
    meta = backend.plan(step) if graph is None else backend.plan(step, graph)
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, backend, meta)
    return backend.forward(q, 0, scale, batch).float()


def _wrapper(inner, layers=(), max_graph=(0, 0)) -> TritonPrefillAttention:
    return TritonPrefillAttention(
        inner, CPU, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_context=64,
        max_graph=max_graph, layers=layers,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_prefill_matches_the_torch_backend(kv_dtype: torch.dtype) -> None:
    pool, step, q = _prefill(kv_dtype)
    torch_backend = TorchAttentionBackend(CPU)
    triton = _wrapper(torch_backend)
    assert isinstance(triton.plan(step), PrefillKernelPlan)
    ref = _attend(torch_backend, step, pool, q.float())
    got = _attend(triton, step, pool, q)
    assert (got - ref).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(scale=0.3, logit_softcap=1.5),
        AttentionSpec(scale=D**-0.5, sliding_window=5),  # prompts of 9 to 42 slots cross it
        AttentionSpec(scale=0.3, logit_softcap=1.5, sliding_window=4),
    ],
    ids=["softcap", "window", "softcap-window"],
)
def test_layer_spec_in_prefills_matches_the_torch_backend(spec: AttentionSpec) -> None:
    pool, step, q = _prefill(torch.bfloat16)
    torch_backend = TorchAttentionBackend(CPU, layers=(spec,))
    triton = _wrapper(torch_backend, layers=(spec,))
    ref = _attend(torch_backend, step, pool, q.float(), spec.scale)
    got = _attend(triton, step, pool, q, spec.scale)
    plain = _attend(TorchAttentionBackend(CPU), step, pool, q.float(), spec.scale)
    assert (got - ref).abs().max().item() < ATOL
    assert (plain - ref).abs().max().item() > 10 * ATOL, "the spec changed nothing here"


def test_graph_buffers_give_the_eager_result() -> None:
    """A prefill graph's plan goes into fixed buffers (the same addresses at every replay), its
    tile map padded to the graph's capacity; run on CPU without capture, the padded step (pad
    sequences over the pad slot, as PrefillGraphs builds it) must compute what the eager plan
    computes for the real tokens."""
    pool, step, q = _prefill(torch.bfloat16)
    triton = _wrapper(TorchAttentionBackend(CPU), max_graph=(128, 5))
    eager = _attend(triton, step, pool, q)
    tokens = step.input_ids.numel()
    padded = pad_prefill(step, 64, 5)
    q_padded = torch.cat([q, torch.zeros(64 - tokens, HQ, D, dtype=q.dtype)])
    graph = triton.prefill_graph_attention(5, 64)
    assert isinstance(graph, PrefillKernelGraph)
    addresses = set()
    for _ in range(2):  # re-planning into the same buffers
        got = _attend(triton, padded, pool, q_padded, graph=graph)
        assert torch.equal(got[:tokens], eager)
        addresses.add(triton._buffers["tiles"].data_ptr())
    assert len(addresses) == 1
    with pytest.raises(ValueError, match="exceeds the Triton prefill buffers"):
        triton.plan(pad_prefill(step, 256, 5), graph=triton.prefill_graph_attention(5, 256))


def test_other_steps_go_to_the_wrapped_backend() -> None:
    """Beam steps reach the beam wrapper below, single-token decodes the torch backend."""
    torch_backend = TorchAttentionBackend(CPU)
    beam = TritonBeamAttention(torch_backend, CPU, max_rows=64, max_prompt_slots=256)
    triton = _wrapper(beam)
    assert triton.name == "torch+triton-beam+triton-prefill"
    rows = 4
    step = prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64), positions=torch.zeros(rows, dtype=torch.int64),
        prompts=torch.arange(1, 8), prompt_lens=torch.tensor([3, 4]),
        row_request=torch.tensor([0, 0, 1, 1]), history=torch.zeros(rows, 0, dtype=torch.int64),
        own=torch.arange(20, 24),
    )  # fmt: skip
    assert type(triton.plan(step)).__name__ == "BeamKernelPlan"
    decode = prepare_prefill([[1, 2, 3], [4, 5]], [torch.tensor([5, 6, 7]), torch.tensor([8, 9])],
                             [2, 1])  # fmt: skip
    assert not isinstance(triton.plan(decode), PrefillKernelPlan)


class _Limited(TorchAttentionBackend):
    """A backend whose kernels take only FlashInfer's head dims (on the CPU, the torch backend
    declaring them): the test model's head dim 32 is not among them."""

    head_dims = (64, 128, 256)


def test_one_query_prefills_come_here_when_the_wrapped_backend_lacks_the_head_dim() -> None:
    """A fully cached prompt's one-token prefill (one query per sequence) goes to the wrapped
    backend, unless that backend has no kernels for the model's head dim (FlashInfer and the
    embedded model's 16: such a prefill failed on a GPU without prefill graphs, session 28);
    then the Triton kernel takes it, through the beam wrapper in between too, and computes
    what the torch backend computes. Beam steps still go to the beam wrapper."""
    pool, step, _ = _prefill(torch.bfloat16, new=(1, 1, 1), cached=(8, 5, 20))
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert not isinstance(_wrapper(TorchAttentionBackend(CPU)).plan(step), PrefillKernelPlan)
    beam = TritonBeamAttention(_Limited(CPU), CPU, max_rows=64, max_prompt_slots=256)
    triton = _wrapper(beam)
    assert triton.one_query and isinstance(triton.plan(step), PrefillKernelPlan)
    ref = _attend(TorchAttentionBackend(CPU), step, pool, q.float())
    assert (_attend(triton, step, pool, q) - ref).abs().max().item() < ATOL
    rows = 2
    beam_step = prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64), positions=torch.zeros(rows, dtype=torch.int64),
        prompts=torch.arange(1, 4), prompt_lens=torch.tensor([3]),
        row_request=torch.tensor([0, 0]), history=torch.zeros(rows, 0, dtype=torch.int64),
        own=torch.arange(20, 22),
    )  # fmt: skip
    assert type(triton.plan(beam_step)).__name__ == "BeamKernelPlan"


def _tiny_engine(tmp_path: Path, **settings) -> Engine:
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(tmp_path, spec.examples[0].hf_config, level_sizes=LEVELS)
    catalog = write_catalog(tmp_path / "c.json", random_codes(300, seed=5))
    cfg = EngineConfig(
        model_path=str(tmp_path), device="cpu", dtype="bfloat16", show_progress=False,
        kv_cache_tokens=4096, enable_fused_rms_fp8=False, enable_fused_silu_fp8=False,
        enable_fused_qk_rope_kv=False, **settings,
    )  # fmt: skip
    return Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))


def test_generate_with_triton_prefills_matches_the_backend(tmp_path: Path) -> None:
    """The whole engine (BF16 on CPU), prompts sharing a cached prefix: the same beams and
    scores as with the torch backend's prefill, up to bf16 attention noise."""
    engines = [
        _tiny_engine(tmp_path, prefill_attention="backend"),
        _tiny_engine(tmp_path, prefill_attention="triton", triton_on_cpu=True),
    ]
    assert isinstance(engines[1].runner.attn_backend, TritonPrefillAttention)
    assert_searches_alike(engines, BEAM_TOL, requests=3, n=6)


def test_triton_prefills_need_triton_here(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--prefill-attention triton needs Triton kernels here"):
        _tiny_engine(tmp_path, prefill_attention="triton")


@pytest.mark.parametrize(
    ("overrides", "head_dim", "kv", "expected", "why"),
    [
        ({}, 128, "fp8_e4m3", "triton", "auto"),
        ({}, 256, "bfloat16", "triton", "auto"),
        ({"device": "cpu"}, 128, "bfloat16", "backend", "device is cpu"),
        ({"dtype": "float16"}, 128, "float16", "backend", "bf16 queries"),
        ({}, 80, "bfloat16", "backend", "head_dim 80"),
        ({"triton_kernels": False, "triton_reason": "no triton"}, 128, "bfloat16", "backend",
         "no triton"),
        ({"prefill_attention": "backend"}, 128, "bfloat16", "backend", "asked for"),
        # the fresh prefill: FlashInfer's FA3 on sm90, for the head dims it is built for
        ({"attention_backend": "flashinfer", "sm": 9}, 128, "fp8_e4m3", "fresh", "FA3"),
        ({"attention_backend": "flashinfer", "sm": 9}, 256, "bfloat16", "fresh", "FA3"),
        ({"attention_backend": "flashinfer", "sm": 9}, 32, "bfloat16", "triton", "auto"),
        ({"attention_backend": "flashinfer", "sm": 8}, 128, "fp8_e4m3", "triton", "auto"),
        ({"attention_backend": "flashinfer", "sm": 10}, 128, "fp8_e4m3", "triton", "auto"),
        ({"attention_backend": "torch", "sm": 9}, 128, "fp8_e4m3", "triton", "auto"),
        ({"attention_backend": "flashinfer", "sm": 9, "dtype": "float16"}, 128, "float16",
         "backend", "bf16 queries"),
        ({"attention_backend": "flashinfer", "sm": 9, "prefill_attention": "triton"}, 128,
         "bfloat16", "triton", "asked for"),
    ],
)  # fmt: skip
def test_auto_prefill_attention_takes_the_kernel_where_it_applies(
    overrides: dict, head_dim: int, kv: str, expected: str, why: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from flashrec_core import config

    settings = {"model_path": "<none>", "device": "cuda", "dtype": "bfloat16",
                "kv_cache_dtype": kv, "triton_kernels": True, **overrides}  # fmt: skip
    sm = settings.pop("sm", 9)  # the GPU's compute capability major, 9 = Hopper
    monkeypatch.setattr(config, "cuda_capability", lambda: sm)
    choice, reason = config._resolve_prefill_attention(EngineConfig(**settings), head_dim)
    assert (choice, why in reason) == (expected, True), reason


def test_fp8_attention_scores_run_the_engine_and_refuse_what_they_cannot_apply(
    tmp_path: Path,
) -> None:
    """The flag reaches the Triton beam wrapper of an engine (not the prefill kernel's, whose
    FP8 dot gained nothing on an H100), whose search then returns catalog items; it is
    refused, with what to change, over a bf16 cache or where the beam kernel does not run."""
    engine = _tiny_engine(
        tmp_path, kv_cache_dtype="fp8_e4m3", triton_on_cpu=True, prefill_attention="triton",
        beam_attention="triton", fp8_attention_scores=True,
    )  # fmt: skip
    backend = engine.runner.attn_backend
    assert isinstance(backend, TritonPrefillAttention)
    assert isinstance(backend.inner, TritonBeamAttention) and backend.inner.fp8_scores
    [result] = engine.generate([engine.make_request(prompt="w1 w2 w3", n=4)])
    assert len(result.choices) == 4
    assert all(engine.catalog.row_of(c.codes) >= 0 for c in result.choices)
    with pytest.raises(ValueError, match="needs an FP8 KV cache, but kv_cache_dtype is bfloat16"):
        _tiny_engine(tmp_path, triton_on_cpu=True, prefill_attention="triton",
                     fp8_attention_scores=True)  # fmt: skip
    with pytest.raises(ValueError, match="applies to the Triton beam kernel, which does not run"):
        _tiny_engine(tmp_path, kv_cache_dtype="fp8_e4m3", triton_on_cpu=True,
                     prefill_attention="triton", fp8_attention_scores=True)  # fmt: skip
