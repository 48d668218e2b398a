"""Beam steps through the Triton beam-cascade kernel (interpreted on CPU) vs the torch backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrec_core.attention import TorchAttentionBackend, window_shared_prefix
from flashrec_core.attention.triton_beam import BeamKernelPlan, TritonBeamAttention
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import prepare_beam_decode
from flashrec_core.engine.engine import Engine
from flashrec_core.engine.model_runner import prepare_prefill
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
# Both paths: fp32 softmax over the same slots; the kernel rounds its output to bf16 (2^-9
# relative on values |v| <= ~3) and sums in another order: 2e-2 absolute covers both.
ATOL = 2e-2
BEAM_TOL = 0.05
"""Per-beam log-prob gap between the two engines: three steps of ~1e-2 bf16 attention noise."""


def _beam_step(kv_dtype: torch.dtype, widths: tuple[int, ...] = (3, 1, 5)):
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, HKV, D, 256, kv_dtype, CPU)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, generator=gen).to(kv_dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, generator=gen).to(kv_dtype))
    prompt_lens = torch.tensor([7, 1, 12])
    row_request = torch.repeat_interleave(torch.arange(3), torch.tensor(list(widths)))
    rows = row_request.numel()
    step = prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64), positions=torch.zeros(rows, dtype=torch.int64),
        prompts=torch.randint(1, 100, (int(prompt_lens.sum()),), generator=gen),
        prompt_lens=prompt_lens, row_request=row_request,
        history=torch.randint(100, 200, (rows, 1), generator=gen),
        own=torch.arange(200, 200 + rows),
    )  # fmt: skip
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    return pool, step, qkv[:, : HQ * D].view(rows, HQ, D)  # strided, as models pass it


def _attend(backend, step, pool, q, scale: float = D**-0.5) -> torch.Tensor:
    meta = backend.plan(step)
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, backend, meta)
    return backend.forward(q, 0, scale, batch).float()


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(scale=0.3, logit_softcap=1.5),
        AttentionSpec(scale=D**-0.5, sliding_window=5),  # prompts of 7 and 12 slots cross it
        AttentionSpec(scale=0.3, logit_softcap=1.5, sliding_window=4),
    ],
    ids=["softcap", "window", "softcap-window"],
)
def test_layer_spec_in_beam_steps_matches_the_torch_backend(spec: AttentionSpec) -> None:
    """Contract v2 on the beam path: the kernel's soft-cap and the windowed prompt level equal
    the torch reference's masked, capped attention over the flat slot lists."""
    pool, step, q = _beam_step(torch.bfloat16)
    torch_backend = TorchAttentionBackend(CPU, layers=(spec,))
    triton = TritonBeamAttention(
        torch_backend, CPU, max_rows=64, max_prompt_slots=256, layers=(spec,), head_dim=D
    )
    ref = _attend(torch_backend, step, pool, q.float(), spec.scale)
    got = _attend(triton, step, pool, q, spec.scale)
    plain = _attend(TorchAttentionBackend(CPU), step, pool, q.float(), spec.scale)
    assert (got - ref).abs().max().item() < ATOL
    assert (plain - ref).abs().max().item() > 10 * ATOL, "the spec changed nothing here"


def test_window_shared_prefix_keeps_the_last_prompt_slots() -> None:
    _, step, _ = _beam_step(torch.bfloat16)
    sp = step.shared_prefix
    cut = window_shared_prefix(sp, 4)  # own slots: 2 (history + own), so 2 prompt slots remain
    assert cut.prefix_kv_indptr.tolist() == [0, 2, 3, 5]
    prompts = sp.prefix_kv_indices
    assert cut.prefix_kv_indices.tolist() == [*prompts[5:7], prompts[7], *prompts[18:20]]
    assert window_shared_prefix(sp, None) is sp and window_shared_prefix(sp, 100) is sp
    with pytest.raises(ValueError, match="window must be longer than the SID depth"):
        window_shared_prefix(sp, 2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_beam_step_matches_the_torch_backend(kv_dtype: torch.dtype) -> None:
    pool, step, q = _beam_step(kv_dtype)
    torch_backend = TorchAttentionBackend(CPU)
    triton = TritonBeamAttention(torch_backend, CPU, max_rows=64, max_prompt_slots=256)
    assert isinstance(triton.plan(step), BeamKernelPlan)
    ref = _attend(torch_backend, step, pool, q.float()).view(q.shape[0], -1)
    got = _attend(triton, step, pool, q).view(q.shape[0], -1)
    assert (got - ref).abs().max().item() < ATOL


def test_fp8_scores_reach_the_kernel() -> None:
    """`fp8_scores` (EngineConfig.fp8_attention_scores) reaches the kernel: a beam step equals
    the torch backend's given the queries rounded as the kernel rounds them (each (row, q head)
    row to e4m3 under amax / 448; prompt and own slots alike), and differs from the wrapper's
    without it."""
    pool, step, q = _beam_step(torch.float8_e4m3fn)
    torch_backend = TorchAttentionBackend(CPU)
    fp8 = TritonBeamAttention(torch_backend, CPU, max_rows=64, max_prompt_slots=256,
                              fp8_scores=True)  # fmt: skip
    scale = q.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    rounded = (q.float() / scale).to(torch.float8_e4m3fn).float() * scale
    got = _attend(fp8, step, pool, q)
    assert (got - _attend(torch_backend, step, pool, rounded)).abs().max().item() < ATOL
    plain = TritonBeamAttention(torch_backend, CPU, max_rows=64, max_prompt_slots=256)
    assert not torch.equal(got, _attend(plain, step, pool, q))


def test_graph_buffers_give_the_eager_result() -> None:
    """The CUDA-graph path plans into fixed buffers (views reused across replays); run on CPU
    without capture, it must compute exactly what the eager plan computes."""
    pool, step, q = _beam_step(torch.bfloat16, widths=(4, 4, 4))  # graphs: one width per wave
    triton = TritonBeamAttention(TorchAttentionBackend(CPU), CPU, max_rows=64, max_prompt_slots=256)
    eager = _attend(triton, step, pool, q)
    for _ in range(2):  # re-planning into the same buffers
        meta = triton.plan(step, graph=triton.graph_attention(3, 12))
        [group] = meta.per_group
        assert (
            group.prefix_indptr.data_ptr() == triton._graph_buffers[0]["prefix_indptr"].data_ptr()
        )
        assert group.max_rows_per_request == 4
        batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, triton, meta)
        assert torch.equal(triton.forward(q, 0, D**-0.5, batch).float(), eager)


def test_other_steps_go_to_the_wrapped_backend() -> None:
    torch_backend = TorchAttentionBackend(CPU)
    triton = TritonBeamAttention(torch_backend, CPU, max_rows=64, max_prompt_slots=256)
    step = prepare_prefill([[1, 2, 3]], [torch.tensor([5, 6, 7])])
    assert not isinstance(triton.plan(step), BeamKernelPlan)


def test_generate_with_triton_beam_steps_matches_cascade(tmp_path: Path) -> None:
    """The whole engine (BF16 on CPU): beams and scores as with the torch backend's steps."""
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(tmp_path, spec.examples[0].hf_config, level_sizes=LEVELS)
    catalog = write_catalog(tmp_path / "c.json", random_codes(300, seed=5))
    engines = [
        Engine.from_config(
            EngineConfig(
                model_path=str(tmp_path),
                device="cpu",
                dtype="bfloat16",
                show_progress=False,
                kv_cache_tokens=4096,
                beam_attention=mode,
                triton_on_cpu=mode == "triton",
                enable_fused_rms_fp8=False,
                enable_fused_silu_fp8=False,
                enable_fused_qk_rope_kv=False,
            ),
            SearchConfig(catalog_path=str(catalog)),
        )  # fmt: skip
        for mode in ("cascade", "triton")
    ]
    assert isinstance(engines[1].runner.attn_backend, TritonBeamAttention)
    # The same search over the same weights; attention outputs differ by bf16 rounding only
    # (~1e-2 on a beam's log-prob), so beams may swap ranks, or places at the cut, only when
    # their scores are that close.
    assert_searches_alike(engines, BEAM_TOL, requests=2, n=6)


def test_triton_beam_steps_need_triton_here(tmp_path: Path) -> None:
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(tmp_path, spec.examples[0].hf_config, level_sizes=LEVELS)
    cfg = EngineConfig(
        model_path=str(tmp_path), device="cpu", show_progress=False, kv_cache_tokens=1024,
        beam_attention="triton",
    )  # fmt: skip
    with pytest.raises(ValueError, match="--beam-attention triton needs Triton kernels here"):
        Engine.from_config(cfg, SearchConfig())


@pytest.mark.parametrize(
    ("overrides", "head_dim", "kv", "expected", "why"),
    [
        ({}, 128, "fp8_e4m3", "triton", "auto"),
        ({}, 64, "bfloat16", "triton", "auto"),
        ({"device": "cpu"}, 128, "bfloat16", "cascade", "device is cpu"),
        ({"cascade_attention": False}, 128, "bfloat16", "cascade", "flat per-beam"),
        ({"dtype": "float16"}, 128, "float16", "cascade", "bf16 queries"),
        ({}, 80, "bfloat16", "cascade", "head_dim 80"),
        ({"beam_attention": "cascade"}, 128, "bfloat16", "cascade", "asked for"),
    ],
)  # fmt: skip
def test_auto_beam_attention_takes_the_kernel_where_it_applies(
    overrides: dict, head_dim: int, kv: str, expected: str, why: str
) -> None:
    from flashrec_core.config import _resolve_beam_attention

    settings = {"model_path": "<none>", "device": "cuda", "dtype": "bfloat16",
                "kv_cache_dtype": kv, "triton_kernels": True, **overrides}  # fmt: skip
    choice, reason = _resolve_beam_attention(EngineConfig(**settings), head_dim)
    assert (choice, why in reason) == (expected, True), reason
