"""Every shared Triton kernel compiles for an H100/H200 (sm_90) here, with no GPU: Triton's own
compiler and ptxas produce the cubin (`flashrec_kernels.gpu_compile`). The interpreter never
compiles, so without this a kernel can pass every CPU test and still fail to build on the
device (it happened to the RoPE kernel once).

Runs in a subprocess: under TRITON_INTERPRET=1 (set for these tests) `@triton.jit` makes
interpreted functions, which cannot be compiled."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

_SCRIPT = """
import torch
from flashrec_kernels.gpu_compile import compiled_launches, instruction_mix, loop_schedule, sass
from flashrec_kernels.trie_topk import CsrLevel, DenseLevel
from flashrec_kernels import triton_beam_attention as att, triton_quant, triton_rms_norm
from flashrec_kernels import triton_prefill_attention, triton_rope, triton_silu_mul, triton_trie_topk
from flashrec_kernels import triton_fp8_gemm

T, H, HQ, HKV, D = 4, 2048, 16, 8, 128
bf16, fp8, i32, i64 = torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64
x = torch.zeros(T, H, dtype=bf16)
with compiled_launches(90) as done:
    triton_quant.launch_per_token_quant_fp8(x)
    triton_rms_norm.launch_rms_norm_quant_fp8(x, torch.ones(H, dtype=bf16), 1e-6, x.clone())
    triton_rms_norm.launch_rms_norm_quant_fp8(x, torch.ones(H, dtype=bf16), 1e-6, None)
    triton_silu_mul.launch_silu_mul_quant_fp8(torch.zeros(T, 2 * 6144, dtype=bf16))
    triton_silu_mul.launch_silu_mul_quant_fp8(torch.zeros(T, 2 * 6144, dtype=bf16),
                                              triton_silu_mul.ACT_GELU_TANH)
    # without the L2 eviction hints (the default until session 43; scripts/bench_elementwise.py
    # times it)
    triton_silu_mul.launch_silu_mul_quant_fp8(torch.zeros(T, 2 * 6144, dtype=bf16),
                                              cache_hints=False)
    qkv = torch.zeros(T, (HQ + 2 * HKV) * D, dtype=bf16)
    q, k, v = (qkv[:, :HQ * D].view(T, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D),
               qkv[:, (HQ + HKV) * D:].view(T, HKV, D))
    cache = torch.zeros(64, HKV, D, dtype=fp8)
    cos_sin = torch.zeros(1024, D, dtype=torch.float32)
    pos, loc = torch.zeros(T, dtype=i64), torch.zeros(T, dtype=i64)
    norms = (torch.ones(D, dtype=bf16), torch.ones(D, dtype=bf16))
    triton_rope.launch_rope_norm_store(q, k, v, pos, cos_sin, cache, cache.clone(), loc, norms, 1e-6, D)
    triton_rope.launch_rope_norm_store(q, k, v, pos, cos_sin, cache, cache.clone(), loc, (None, None),
                                       1e-6, D // 2)
    lp = torch.zeros(T, 8192, dtype=torch.float32)
    nodes, parent = torch.zeros(T, dtype=i64), torch.zeros(T, dtype=torch.float32)
    triton_trie_topk.launch_trie_topk(DenseLevel(torch.zeros(16, 8192, dtype=i32)), nodes, parent,
                                      lp, 50, None)
    csr = CsrLevel(torch.zeros(17, dtype=i64), torch.zeros(64, dtype=i32), torch.zeros(64, dtype=i32), 200)
    triton_trie_topk.launch_trie_topk(csr, nodes, parent, lp, 200, torch.zeros(T, 200))
    rows = torch.tensor([0, 2, 4], dtype=i32)
    att.launch_beam_cascade_attention(
        q, cache, cache.clone(), rows, torch.zeros(8, dtype=i32), rows,
        torch.zeros(T, 2, dtype=i32), 0.088, 2, torch.zeros(T, HQ, D, dtype=bf16))
    att.launch_beam_cascade_attention(
        q, cache, cache.clone(), rows, torch.zeros(8, dtype=i32), rows,
        torch.zeros(T, 2, dtype=i32), 0.088, 2, torch.zeros(T, HQ, D, dtype=bf16),
        logit_softcap=50.0)
    # the experimental FP8 score dot (scripts/bench_attention.py)
    att.launch_beam_cascade_attention(
        q, cache, cache.clone(), rows, torch.zeros(8, dtype=i32), rows,
        torch.zeros(T, 2, dtype=i32), 0.088, 2, torch.zeros(T, HQ, D, dtype=bf16),
        fp8_scores=True)
    ptr = torch.tensor([0, T], dtype=i32)
    for d, softcap, window, splits in ((D, None, None, 1), (D, 50.0, 64, 1), (256, None, None, 1),
                                       (D, None, None, 4)):
        qd, cd = torch.zeros(T, HQ, d, dtype=bf16), torch.zeros(64, HKV, d, dtype=fp8)
        triton_prefill_attention.launch_prefill_attention(
            qd, cd, cd.clone(), ptr, ptr, torch.zeros(T, dtype=i32), torch.zeros(2, 2, dtype=i32),
            0.088, torch.zeros(T, HQ, d, dtype=bf16), softcap, window, 128 if d <= 128 else 64,
            num_splits=splits)
    # the experimental FP8 score dot (scripts/bench_prefill_attention.py)
    qd, cd = torch.zeros(T, HQ, D, dtype=bf16), torch.zeros(64, HKV, D, dtype=fp8)
    triton_prefill_attention.launch_prefill_attention(
        qd, cd, cd.clone(), ptr, ptr, torch.zeros(T, dtype=i32), torch.zeros(2, 2, dtype=i32),
        0.088, torch.zeros(T, HQ, D, dtype=bf16), None, None, 128, num_splits=1, fp8_scores=True)
    # the small-row GEMM at a beam step of 4 and of 50 rows (mma and wgmma tiles), with a bias
    for rows in (4, 50):
        a, w = torch.zeros(rows, H, dtype=fp8), torch.zeros(4096, H, dtype=fp8)
        triton_fp8_gemm.launch_fp8_gemm(a, torch.ones(rows), w, torch.ones(4096),
                                        torch.zeros(4096, dtype=bf16), bf16)
    # split-K (the launch table may pick it): the split programs and the partials' sum
    triton_fp8_gemm.launch_fp8_gemm(a, torch.ones(50), w, torch.ones(4096), None, bf16,
                                    block_m=64, block_n=16, block_k=128, split_k=4)
names = sorted({c.kernel for c in done})
# the hints reach the instructions of the default launches (SiLU and GELU): pass 1's loads keep
# the row in L2, pass 2's let it go, the codes stream past it; the launch without them has none
silu = [c.ptx for c in done if c.kernel == "_silu_mul_quant_fp8_kernel"]
hinted = [ptx for ptx in silu if "evict_last" in ptx]
assert [ptx in hinted for ptx in silu] == [True, True, False], len(hinted)
assert all("evict_first" in ptx and "st.global.cs" in ptx for ptx in hinted), len(hinted)
# the GPU side of triton_fp8 (session 40; before it these kernels were bound by instruction
# issue): FP8 rounded by the conversion itself, without the interpreter's pre-rounding (its
# magic constant 1.5 * 2^23, 0f4B400000, absent); IEEE divisions only per row (the scale, its
# reciprocal, and RMSNorm's own two), not per element (9-11 in these PTX files before); the
# SiLU and GELU gates through ex2 / rcp .approx.ftz
row_divisions = {"_per_token_quant_fp8_kernel": 2, "_rms_norm_quant_fp8_kernel": 4,
                 "_silu_mul_quant_fp8_kernel": 2}
for c in done:
    if c.kernel in row_divisions:
        assert "cvt.rn.satfinite.e4m3x2.f32" in c.ptx and "0f4B400000" not in c.ptx, c.kernel
        assert c.ptx.count("div.rn.f32") <= row_divisions[c.kernel], c.kernel
assert all("ex2.approx.ftz.f32" in ptx and "rcp.approx.ftz.f32" in ptx for ptx in silu)
# the default launch's machine code: the gates on the special-function unit, FP8 packed by F2FP
mix = instruction_mix(sass(silu[0]))
assert mix.get("MUFU", 0) > 0 and mix.get("F2FP", 0) > 0 and sum(mix.values()) > 100, mix
assert all(c.cubin_bytes > 0 for c in done), names
# Register spills (local-memory traffic): none, except in the prefill attention kernel, whose
# launches were chosen by time on the device: its default launch spills none, its soft-cap,
# window, head_dim-256 and split variants 88-216 bytes (compiled, as on the device, with
# 16-byte-aligned arguments specialized; before session 31 these counts came from an
# unspecialized compile and read 8 KB and 0.4-1.2 KB). The beam kernel spilled 84-248 bytes
# until session 41 folded the rows' own slots before the prompt loop (the bf16 query tile had
# stayed live across it); none of its launches here spills now.
timed = ("_beam_cascade_attention_kernel", "_prefill_attention_kernel")
spilled = [(c.kernel, c.registers, c.spill_bytes) for c in done
           if c.spill_bytes and c.kernel != "_prefill_attention_kernel"]
assert not spilled, f"default launches spill registers (kernel, registers, bytes): {spilled}"
for kernel in timed:  # the dots run on Hopper's tensor cores
    assert any("wgmma" in c.ptx for c in done if c.kernel == kernel), kernel
# the FP8 score dots on e4m3 tensor cores, the keys taken as loaded
for kernel in timed:
    assert any(".f32.e4m3.e4m3" in c.ptx for c in done if c.kernel == kernel), kernel
# the schedule the pipeliner gave the prefill kernel's default launch: its loops, each chunk's
# K and V copied asynchronously into shared memory, both dots on the tensor cores
schedule = loop_schedule(next(c for c in done if c.kernel == "_prefill_attention_kernel").ttgir)
for op in ("scf.for", "ttg.async_copy_global_to_local", "ttg.async_wait", "ttng.warp_group_dot "):
    assert any(line.startswith(op) for line in schedule), (op, schedule)
# the beam kernel's unsplit launch over an FP8 cache as `unsplit_stages` gives it on an H100
# or H200: 5 stages, so that K and V get two shared-memory buffers each (one at 3-4), within
# the shared memory the stage choice checks the GPU for
with compiled_launches(90) as five:
    att.launch_beam_cascade_attention(
        q, cache, cache.clone(), ptr, torch.zeros(8, dtype=i32), ptr,
        torch.zeros(T, 2, dtype=i32), 0.088, T, torch.zeros(T, HQ, D, dtype=bf16),
        num_splits=1, num_stages=5)
(beam5,) = five
assert 0 < beam5.shared_bytes <= att.FIVE_STAGE_SHARED_BYTES, beam5.shared_bytes
assert beam5.spill_bytes == 0, beam5.spill_bytes
buffers = [line for line in loop_schedule(beam5.ttgir)
           if line.startswith("ttg.local_alloc : () -> !ttg.memdesc<2x128x128xf8E4M3FN")]
assert len(buffers) == 2, loop_schedule(beam5.ttgir)
print("compiled", len(done) + 1, names)
"""


def test_shared_kernels_compile_for_sm90() -> None:
    from flashrec_kernels.gpu_compile import run_compile_script

    proc = run_compile_script(_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    for kernel in (
        "quant", "rms_norm", "silu_mul", "rope", "trie_topk", "beam_cascade", "prefill", "fp8_gemm",
        "split_k_sum",
    ):  # fmt: skip
        assert kernel in proc.stdout, f"no {kernel} kernel compiled: {proc.stdout}"


def test_compiles_with_ptx_from_a_binary_only_cache(tmp_path, monkeypatch) -> None:
    """The device's runs keep only the cubins in Triton's cache (TRITON_STORE_BINARY_ONLY,
    scripts/gpu_run.sh); a compile-only launch there must still give its PTX and IR, the first
    time (a compile that stores binaries only returns none) and when the cache has the entry."""
    from flashrec_kernels.gpu_compile import run_compile_script

    monkeypatch.setenv("TRITON_STORE_BINARY_ONLY", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    script = """
import os, pathlib
import torch
from flashrec_kernels import triton_quant
from flashrec_kernels.gpu_compile import compiled_launches
for attempt in range(2):
    with compiled_launches(90) as done:
        triton_quant.launch_per_token_quant_fp8(torch.zeros(4, 2048, dtype=torch.bfloat16))
    (launch,) = done
    assert ".entry" in launch.ptx and launch.registers > 0 and launch.ttgir, attempt
    # leave the entry as a binary-only cache holds it
    for f in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("*"):
        if f.suffix in (".ptx", ".ttir", ".ttgir", ".llir", ".source"):
            f.unlink()
print("ok")
"""
    proc = run_compile_script(script)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_kernel_sass_script_counts_each_elementwise_kernel() -> None:
    """scripts/kernel_sass.py (instruction counts before a device call) runs here."""
    from pathlib import Path

    from flashrec_kernels.gpu_compile import run_compile_script

    script = Path(__file__).parents[2] / "scripts" / "kernel_sass.py"
    proc = run_compile_script(script.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    for kernel in ("per_token_quant", "rms_norm", "silu_mul", "rope_norm_store", "beam_cascade",
                   "prefill_attention"):  # fmt: skip
        line = next((x for x in lines if kernel in x), None)
        assert line is not None and " instructions, " in line, proc.stdout
    # the beam kernel's prompt loop, one 128-key chunk an iteration: 997 instructions a thread
    # before session 41 took the whole chunks' masks and the scale's multiply out, 640 after;
    # both dots on the tensor cores (16 HGMMA)
    beam = lines.index(next(x for x in lines if x.startswith("_beam_cascade_attention_kernel")))
    loop = lines[beam + 2]
    assert loop.startswith("  loop body: ") and "HGMMA 16" in loop, proc.stdout
    assert int(loop.split()[2]) <= 700, loop


def test_loop_bodies_of_a_listing() -> None:
    """gpu_compile.loop_bodies: the lines from a label to a branch back to it, once per loop; a
    forward branch and a trap (a label branching to itself) are no loops."""
    from flashrec_kernels.gpu_compile import loop_bodies

    def op(i: int, text: str) -> str:
        return f"        /*{i * 16:04x}*/                   {text} ;"

    listing = "\n".join([
        op(0, "MOV R1, RZ"), ".L_x_0:", op(1, "FADD R2, R2, R3"), op(2, "FADD R2, R2, R3"),
        op(3, "@P0 BRA `(.L_x_1)"), op(4, "FMUL R2, R2, R3"), ".L_x_1:",
        op(5, "@!P1 BRA `(.L_x_0)"), ".L_x_2:", op(6, "BRA `(.L_x_2)"),
    ])  # fmt: skip
    assert loop_bodies(listing) == [{"FADD": 2, "BRA": 2, "FMUL": 1}]
