"""Prefill attention alone, one layer: FlashInfer (the engine's prefill-graph wrappers, split-KV on;
off crashes FlashInfer 0.6.13, see flashrec_core/attention/flashinfer.py) vs the Triton prefill
kernel in several launch configurations, unsplit and split, on the same paged FP8 pool.

Shape: the bench preset's attention (16 q / 8 kv heads, head_dim 128), FP8 KV over scattered slots.
Each case is one prefill step: fresh prompts, prompts after a cached prefix, and a few new tokens
over a long cached prompt. Timed with `triton.testing.do_bench` (CUDA events); every Triton
configuration's output is checked against FlashInfer's before it is timed. Each case also times
the default launch over the same keys and values laid out otherwise (`_layout_rows`): FP8 in
consecutive slots, and bf16 (the FP8 values, exactly) in consecutive and scattered slots: what
the gather of scattered slots and the FP8 -> fp16 conversion of every key cost. Two experiments
with FP8 queries: the default launch with its score dot on FP8 operands (`fp8_scores`), and
FlashInfer's FA3 (sm90) paged prefill (`_fa3_fp8_rows`; 0.6.13 runs an FP8 cache on sm90 only
with FP8 queries), each with its error against FlashInfer's bf16-query output. And FA3's ragged
prefill over bf16 keys in consecutive rows (`_fa3_ragged_rows`): what attending over a prefill's
own fresh bf16 keys, rather than the FP8 cache, would cost; and the engine's
`--prefill-attention fresh` path as a layer runs it (`_fresh_rows`: the copies and FA3, and
without the own rows' copy, which the fused RoPE kernel writes in the engine). Usage
(on the GPU):
    python scripts/bench_prefill_attention.py [OUT_DIR [CASE_SUBSTRING]]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
import triton.testing

from flashrec_core.attention.flashinfer import FlashInferAttentionBackend
from flashrec_core.engine.model_runner import prepare_prefill
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch
from flashrec_kernels.prefill_attention import prefill_tiles
from flashrec_kernels.triton_prefill_attention import launch_prefill_attention

HQ, HKV, D = 16, 8, 128
DEV = torch.device("cuda")
# (name, new tokens per prompt, cached tokens per prompt, prompts)
CASES = [
    ("1 fresh x 1024", 1024, 0, 1),
    ("1 x 960 after 64 cached", 960, 64, 1),
    ("8 x 960 after 64 cached", 960, 64, 8),
    ("16 x 512 fresh", 512, 0, 16),
    ("1 fresh x 4096", 4096, 0, 1),
    ("1 x 16 after 1024 cached", 16, 1024, 1),
    ("16 x 16 after 1024 cached", 16, 1024, 16),
    ("1 x 16 after 8192 cached", 16, 8192, 1),
]
# (block_m, block_n, num_warps, num_stages)
CONFIGS = [
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 5), (128, 128, 4, 2), (128, 64, 8, 2),
    (128, 64, 8, 3), (128, 64, 8, 5), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
    (64, 128, 8, 2), (64, 32, 4, 3),
]  # fmt: skip
"""The default first (its output is the one printed); session 20's H200 run timed 8 of these
(docs/benchmarks.md). 5 stages: the first depth at which Triton 3.6 gives K and V two
shared-memory buffers, so a chunk's copies overlap the chunk before's dots (at 2-4 stages one
buffer each: `flashrec_kernels.gpu_compile.loop_schedule`, session 35)."""


def _case(new: int, cached: int, prompts: int, slots: int):
    gen = torch.Generator().manual_seed(0)
    total = new + cached
    perm = torch.randperm(slots - 1, generator=gen) + 1
    seq_slots = [perm[i * total : (i + 1) * total] for i in range(prompts)]
    ids = [[1] * total for _ in range(prompts)]
    return prepare_prefill(ids, seq_slots, [cached] * prompts)


def _flops(new: int, cached: int, prompts: int) -> float:
    seen = sum(cached + i + 1 for i in range(new))  # keys each query attends
    return 4.0 * D * HQ * seen * prompts


def _flashinfer_us(step, pool: KVPool, q: torch.Tensor, prompts: int):
    """(us, output) of FlashInfer's prefill as a prefill graph replays it (graph-mode wrappers)."""
    fi = FlashInferAttentionBackend(
        DEV, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, q_dtype=torch.bfloat16,
        kv_dtype=pool.dtype, max_rows=8192, max_requests=64, max_context=16384,
    )  # fmt: skip
    meta = fi.plan(step, graph=fi.prefill_graph_attention(prompts, q.shape[0]))
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, fi, meta)
    run = functools.partial(fi.forward, q, 0, D**-0.5, batch)
    return triton.testing.do_bench(run, rep=100) * 1e3, run().float()


def _triton_us(
    step, pool: KVPool, q: torch.Tensor, config: tuple[int, int, int, int], splits: int | None,
    f16_dots: bool | None = None, fp8_scores: bool = False,
):  # fmt: skip
    """(us, output) of the Triton kernel in one launch configuration (`splits` None: the
    kernel's own choice of split-KV; `f16_dots` None: the kernel's own choice of dot type;
    `fp8_scores`: the score dot on FP8 operands, the queries rounded in the kernel)."""
    bm, bn, warps, stages = config
    tiles = prefill_tiles(step.qo_indptr, step.kv_indptr, HQ // HKV, bm).to(DEV)
    out = torch.empty_like(q)
    run = functools.partial(
        launch_prefill_attention, q, pool.k_cache[0], pool.v_cache[0],
        step.qo_indptr.to(DEV, torch.int32), step.kv_indptr.to(DEV, torch.int32),
        step.kv_indices.to(DEV, torch.int32), tiles, D**-0.5, out, None, None, bm, bn,
        num_warps=warps, num_stages=stages, num_splits=splits, f16_dots=f16_dots,
        fp8_scores=fp8_scores,
    )  # fmt: skip
    run()
    return triton.testing.do_bench(run, rep=100) * 1e3, out.float()


def _label(*what: object) -> None:
    """What runs next, printed before it runs: a kernel fault surfaces at the next sync, so the
    last label names the launch that faulted."""
    print("  running", *what, flush=True)


def _bench_case(name: str, new: int, cached: int, prompts: int) -> dict:
    slots = prompts * (new + cached) + 1024
    step = _case(new, cached, prompts, slots)
    kv_dtype = torch.float8_e4m3fn
    pool = KVPool(1, HKV, D, slots, kv_dtype, DEV)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, device=DEV).to(kv_dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, device=DEV).to(kv_dtype))
    q = torch.randn(step.input_ids.numel(), HQ, D, device=DEV, dtype=torch.bfloat16)
    flops = _flops(new, cached, prompts)
    row = {"case": name, "tokens": q.shape[0], "gflop": flops / 1e9}
    _label(name, "FlashInfer")
    row["flashinfer_split_us"], ref = _flashinfer_us(step, pool, q, prompts)
    best = None
    _label(name, "Triton default, one split")
    row["triton_default_nosplit_us"], _ = _triton_us(step, pool, q, CONFIGS[0], 1)
    _label(name, "Triton default, bf16 dots (before session 27)")
    us, got = _triton_us(step, pool, q, CONFIGS[0], None, f16_dots=False)
    row["triton_bf16_dots_us"], row["triton_bf16_dots_maxdiff"] = us, float((got - ref).abs().max())
    for config in CONFIGS:
        _label(name, "Triton", config)
        us, got = _triton_us(step, pool, q, config, None)
        key = "triton_m{}_n{}_w{}_s{}".format(*config)
        row[key + "_us"], row[key + "_maxdiff"] = us, float((got - ref).abs().max())
        if best is None or us < best[1]:
            best = (key, us)
    row["best"], row["best_us"] = best
    _label(name, "Triton default, FP8 score dot (an experiment)")
    us, got = _triton_us(step, pool, q, CONFIGS[0], None, fp8_scores=True)
    row["triton_fp8_scores_us"] = us
    row["triton_fp8_scores_maxdiff"] = float((got - ref).abs().max())
    row["triton_fp8_scores_meandiff"] = float((got - ref).abs().mean())
    row["best_tflops"] = flops / (best[1] * 1e-6) / 1e12
    row.update(_layout_rows(name, step, pool, q, ref))
    _label(name, "FlashInfer FA3, FP8 queries")
    try:
        row.update(_fa3_fp8_rows(step, pool, q, ref))
    except Exception as exc:  # a JIT or plan failure is a finding, not the end of the run
        row["fa3_fp8q_error"] = f"{type(exc).__name__}: {exc}"[:500]
    _label(name, "FlashInfer FA3, bf16 ragged keys")
    try:
        row.update(_fa3_ragged_rows(step, pool, q, ref, new))
    except Exception as exc:
        row["fa3_ragged_error"] = f"{type(exc).__name__}: {exc}"[:500]
    _label(name, "--prefill-attention fresh (copies + FA3)")
    try:
        row.update(_fresh_rows(step, pool, q, ref))
    except Exception as exc:
        row["fresh_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return row


def _fresh_rows(step, pool: KVPool, q: torch.Tensor, ref: torch.Tensor) -> dict:
    """The engine's fresh prefill (attention/fresh_prefill.py) as one layer runs it, eagerly:
    the own rows and the cached context copied into its buffers, then FA3 over them. The
    layer's K/V are strided views of a qkv buffer holding the pool's own values in bf16 (exact),
    so the output matches FlashInfer's over the pool to rounding."""
    from flashrec_core.attention import TorchAttentionBackend
    from flashrec_core.attention.fresh_prefill import FreshPrefillAttention, FreshPrefillPlan

    fresh = FreshPrefillAttention(
        TorchAttentionBackend(DEV), DEV, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
        dtype=torch.bfloat16, triton_copies=True,
    )  # fmt: skip
    plan = fresh.plan(step)
    assert isinstance(plan, FreshPrefillPlan), "a prefill with less context than new tokens"
    tokens = q.shape[0]
    qkv = torch.empty(tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=DEV)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(tokens, HKV, D)
    own = step.out_cache_loc.to(DEV)
    k.copy_(pool.k_cache[0][own].to(torch.bfloat16))
    v.copy_(pool.v_cache[0][own].to(torch.bfloat16))
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, fresh, plan)
    run = functools.partial(fresh.forward, q, 0, D**-0.5, batch, (k, v))
    got = run().float()
    row = {
        "fresh_us": triton.testing.do_bench(run, rep=100) * 1e3,
        "fresh_maxdiff": float((got - ref).abs().max()),
        "fresh_context_rows": int(plan.context_rows.numel()),
    }
    if plan.buffers is not None:  # the own rows written by the fused RoPE kernel (its mirror):
        batch.claim_kv_mirror(0)  # what is left here is the context's copy and FA3
        row["fresh_mirrored_us"] = triton.testing.do_bench(run, rep=100) * 1e3
        row["fresh_mirrored_maxdiff"] = float((run().float() - ref).abs().max())
    return row


def _fa3_ragged_rows(step, pool: KVPool, q: torch.Tensor, ref: torch.Tensor, new: int) -> dict:
    """FlashInfer's FA3 (sm90) ragged prefill on bf16 queries, keys and values in consecutive
    rows (the FP8 pool's values, exactly): what a prefill would cost that attends over its own
    fresh bf16 keys rather than the FP8 cache. Timed over every key of each prompt (the same work
    as the kernels above; its output checked against FlashInfer's) and over the new tokens'
    keys alone (what such a prefill's own part would be; a cached prefix would add a short
    pass over the cache and a merge of the two)."""
    import flashinfer

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    keys = pool.k_cache[0][step.kv_indices.to(DEV).long()].to(torch.bfloat16)
    values = pool.v_cache[0][step.kv_indices.to(DEV).long()].to(torch.bfloat16)
    qo_indptr = step.qo_indptr.to(DEV, torch.int32)
    kv_indptr = step.kv_indptr.to(DEV, torch.int32)
    # the last `new` keys of each prompt: its own tokens
    own = torch.cat([torch.arange(int(end) - new, int(end)) for end in step.kv_indptr[1:]]).to(DEV)
    rows = {}
    for label, k, v, indptr in (
        ("all", keys, values, kv_indptr),
        ("own", keys[own], values[own], qo_indptr),
    ):
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(
            qo_indptr, indptr, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16,
        )  # fmt: skip
        attend = functools.partial(wrapper.run, q, k.contiguous(), v.contiguous())
        got = attend().float()
        rows[f"fa3_ragged_{label}_us"] = triton.testing.do_bench(attend, rep=100) * 1e3
        if label == "all":
            rows["fa3_ragged_all_maxdiff"] = float((got - ref).abs().max())
    return rows


def _fa3_fp8_rows(step, pool: KVPool, q: torch.Tensor, ref: torch.Tensor) -> dict:
    """FlashInfer's FA3 paged prefill over the same FP8 pool with FP8 queries, one scale a q head
    (its amax / 448, as FA3's per-head `scale_q` takes it): timed alone and with the
    quantization (torch ops; an engine would fuse it into the RoPE kernel). Its max |diff|
    against FlashInfer's bf16-query output, and against the Triton kernel given the same
    quantized queries (dequantized to bf16): the queries' rounding apart from the kernel's."""
    import flashinfer

    fp8 = torch.float8_e4m3fn
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    kv_indptr = step.kv_indptr.to(DEV, torch.int32)
    wrapper.plan(
        step.qo_indptr.to(DEV, torch.int32), kv_indptr, step.kv_indices.to(DEV, torch.int32),
        torch.ones(kv_indptr.numel() - 1, dtype=torch.int32, device=DEV), HQ, HKV, D, 1,
        causal=True, q_data_type=fp8, kv_data_type=pool.dtype, o_data_type=torch.bfloat16,
    )  # fmt: skip
    kv = (pool.k_cache[0].unsqueeze(1), pool.v_cache[0].unsqueeze(1))
    ones = torch.ones(HKV, dtype=torch.float32, device=DEV)

    def quantize() -> tuple[torch.Tensor, torch.Tensor]:
        scale = q.abs().amax(dim=(0, 2)).float().clamp(min=1e-12) / torch.finfo(fp8).max
        return (q / scale[None, :, None]).to(fp8), scale

    q8, scale = quantize()
    attend = functools.partial(wrapper.run, q8, kv, scale, ones, ones)
    got = attend().float()

    def quantized_and_attend() -> torch.Tensor:
        queries, scales = quantize()
        return wrapper.run(queries, kv, scales, ones, ones)

    rows = {
        "fa3_fp8q_us": triton.testing.do_bench(attend, rep=100) * 1e3,
        "fa3_fp8q_with_quant_us": triton.testing.do_bench(quantized_and_attend, rep=100) * 1e3,
        "fa3_fp8q_maxdiff": float((got - ref).abs().max()),
        "fa3_fp8q_meandiff": float((got - ref).abs().mean()),
    }
    dequantized = (q8.float() * scale[None, :, None]).to(torch.bfloat16)
    _, same_q = _triton_us(step, pool, dequantized, CONFIGS[0], None)
    rows["fa3_fp8q_vs_triton_same_q_maxdiff"] = float((got - same_q).abs().max())
    rows["triton_fp8q_meandiff"] = float((same_q - ref).abs().mean())
    return rows


def _layout_rows(name: str, step, pool: KVPool, q: torch.Tensor, ref: torch.Tensor) -> dict:
    """The default launch over the case's keys and values in other layouts, each holding the
    same values: FP8 in consecutive slots (the sequences' slots renumbered 1, 2, ... in order),
    and bf16 converted from the FP8 pool (exact) in consecutive and scattered slots. Checked
    against FlashInfer's output like the launches above."""
    order = step.kv_indices.long()
    packed = torch.arange(1, order.numel() + 1, dtype=step.kv_indices.dtype)
    contiguous = dataclasses.replace(step, kv_indices=packed)
    rows = {}
    for label, kv_dtype, layout in (
        ("fp8_consecutive", None, contiguous),
        ("bf16_scattered", torch.bfloat16, step),
        ("bf16_consecutive", torch.bfloat16, contiguous),
    ):
        dtype = pool.dtype if kv_dtype is None else kv_dtype
        other = KVPool(1, HKV, D, pool.k_cache[0].shape[0], dtype, DEV)
        for src, dst in ((pool.k_cache[0], other.k_cache[0]), (pool.v_cache[0], other.v_cache[0])):
            if layout is step:
                dst.copy_(src.to(dtype))
            else:  # slot i + 1 takes the value of the case's i-th slot
                dst[1 : order.numel() + 1].copy_(src[order.to(DEV)].to(dtype))
        _label(name, "Triton default,", label)
        us, got = _triton_us(layout, other, q, CONFIGS[0], None)
        rows[f"layout_{label}_us"], rows[f"layout_{label}_maxdiff"] = (
            us,
            float((got - ref).abs().max()),
        )
    return rows


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    only = sys.argv[2] if len(sys.argv) > 2 else ""  # a substring of the case names to run
    rows = []
    for case in (c for c in CASES if only in c[0]):
        row = _bench_case(*case)
        rows.append(row)
        print(
            f"{row['case']:28s} FlashInfer {row['flashinfer_split_us']:7.1f} us | Triton default "
            f"{row['triton_m128_n128_w8_s2_us']:7.1f} us (bf16 dots "
            f"{row['triton_bf16_dots_us']:.1f}, max |diff| {row['triton_bf16_dots_maxdiff']:.4f}; unsplit "
            f"{row['triton_default_nosplit_us']:.1f}), best {row['best']} "
            f"{row['best_us']:7.1f} us ({row['best_tflops']:.0f} TFLOP/s), max |diff| "
            f"{row['triton_m128_n128_w8_s2_maxdiff']:.4f}; default over FP8 in consecutive slots "
            f"{row['layout_fp8_consecutive_us']:.1f} us, bf16 scattered "
            f"{row['layout_bf16_scattered_us']:.1f}, bf16 consecutive "
            f"{row['layout_bf16_consecutive_us']:.1f} (max |diff| "
            f"{max(row[k] for k in row if k.startswith('layout_') and k.endswith('maxdiff')):.4f})",
            flush=True,
        )
        fa3 = row.get("fa3_fp8q_error") or (
            f"{row['fa3_fp8q_us']:.1f} us ({row['fa3_fp8q_with_quant_us']:.1f} with the "
            f"quantization), max |diff| {row['fa3_fp8q_maxdiff']:.4f} (mean "
            f"{row['fa3_fp8q_meandiff']:.5f}; Triton on the same FP8 queries: mean "
            f"{row['triton_fp8q_meandiff']:.5f}, max |diff| to FA3 "
            f"{row['fa3_fp8q_vs_triton_same_q_maxdiff']:.4f})"
        )
        print(
            f"{'':28s} Triton default with the FP8 score dot: {row['triton_fp8_scores_us']:.1f} us, "
            f"max |diff| {row['triton_fp8_scores_maxdiff']:.4f} (mean "
            f"{row['triton_fp8_scores_meandiff']:.5f}); FlashInfer FA3, FP8 queries: {fa3}",
            flush=True,
        )
        ragged = row.get("fa3_ragged_error") or (
            f"{row['fa3_ragged_all_us']:.1f} us over every key (max |diff| "
            f"{row['fa3_ragged_all_maxdiff']:.4f}), {row['fa3_ragged_own_us']:.1f} us over the "
            "new tokens' own keys"
        )
        print(f"{'':28s} FlashInfer FA3 ragged, bf16 keys: {ragged}", flush=True)
        fresh = row.get("fresh_error") or (
            f"{row['fresh_us']:.1f} us (max |diff| {row['fresh_maxdiff']:.4f}, "
            f"{row['fresh_context_rows']} context rows copied)"
        )
        if "fresh_mirrored_us" in row:
            fresh += f"; {row['fresh_mirrored_us']:.1f} us with the own rows mirrored by RoPE"
        print(f"{'':28s} --prefill-attention fresh, copies + FA3: {fresh}", flush=True)
        torch.cuda.empty_cache()
        # after every case: a later case's fault would otherwise lose the earlier ones
        (out / "bench_prefill_attention.json").write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
