"""Static SASS instruction counts of the fused elementwise kernels' and the attention kernels'
default launches at the bench preset's shapes (Qwen3-1.7B: hidden 2048, intermediate 6144, 16 q
/ 8 KV heads of 128, an FP8 cache), compiled for sm_90 on a machine without a GPU
(`flashrec_kernels.gpu_compile`: Triton's compiler, its bundled ptxas and nvdisasm). For a
kernel with loops, each loop body's count too: the part that runs once per iteration (the
attention kernels' key chunks).

A kernel meant to run at memory bandwidth can be bound by instruction issue instead: an H100
issues four warp instructions per SM per cycle, so W warps of I instructions each take about
W x I / (4 x SMs x clock). Session 40 found the SiLU-mul kernel there (~1,550 instructions a
thread, ~110 us of issue against 119 us measured at 8,184 rows) and took it to 840 (95 us);
count before spending a device call. Counts are static: a loop's body counts once, and
Triton may unroll differently after a change, so read the listing (`--dump DIR`) when totals
move oddly. Run without TRITON_INTERPRET. Usage:
    python scripts/kernel_sass.py [--top 10] [--dump DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashrec_kernels import (
    triton_beam_attention,
    triton_prefill_attention,
    triton_quant,
    triton_rms_norm,
    triton_rope,
    triton_silu_mul,
)
from flashrec_kernels.gpu_compile import compiled_launches, instruction_mix, loop_bodies, sass

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM = 2048, 6144, 16, 8, 128
TOKENS = 8192  # a beam step or a prefill chunk: the launch the engine runs most


def launch_all() -> None:
    """The default launch of each kernel on CPU tensors (inside compiled_launches: compiled only)."""
    bf16 = torch.bfloat16
    x = torch.zeros(TOKENS, HIDDEN, dtype=bf16)
    triton_quant.launch_per_token_quant_fp8(x)
    triton_rms_norm.launch_rms_norm_quant_fp8(x, torch.ones(HIDDEN, dtype=bf16), 1e-6, x.clone())
    triton_silu_mul.launch_silu_mul_quant_fp8(torch.zeros(TOKENS, 2 * INTER, dtype=bf16))
    qkv = torch.zeros(TOKENS, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=bf16)
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    q, k, v = (t.view(TOKENS, -1, HEAD_DIM) for t in (q, k, v))
    cache = torch.zeros(TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    slots = torch.zeros(TOKENS, dtype=torch.int64)
    norms = (torch.ones(HEAD_DIM, dtype=bf16), torch.ones(HEAD_DIM, dtype=bf16))
    triton_rope.launch_rope_norm_store(q, k, v, slots, torch.zeros(4096, HEAD_DIM), cache,
                                       cache.clone(), slots, norms, 1e-6, HEAD_DIM)  # fmt: skip
    # the beam kernel's unsplit launch as an H100 / H200 takes it (5 stages over an FP8 cache:
    # `unsplit_stages` asks the GPU, so it is given here), and the prefill kernel's default
    i32 = torch.int32
    ptr = torch.tensor([0, TOKENS], dtype=i32)
    out = torch.zeros(TOKENS, Q_HEADS, HEAD_DIM, dtype=bf16)
    triton_beam_attention.launch_beam_cascade_attention(
        q, cache, cache.clone(), ptr, torch.zeros(1024, dtype=i32), ptr,
        torch.zeros(TOKENS, 2, dtype=i32), 0.088, TOKENS, out, num_splits=1, num_stages=5)  # fmt: skip
    triton_prefill_attention.launch_prefill_attention(
        q, cache, cache.clone(), ptr, ptr, torch.zeros(TOKENS, dtype=i32),
        torch.zeros(2, 2, dtype=i32), 0.088, out, None, None, 128, num_splits=1)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=10, help="opcodes listed per kernel")
    parser.add_argument("--dump", type=Path, help="write each kernel's SASS listing here")
    args = parser.parse_args()
    with compiled_launches(90) as done:
        launch_all()
    for launch in done:
        listing = sass(launch.ptx)
        mix = instruction_mix(listing)
        top = ", ".join(f"{op} {n}" for op, n in list(mix.items())[: args.top])
        print(f"{launch.kernel}: {sum(mix.values())} instructions, {launch.registers} registers")
        print(f"  {top}")
        for body in loop_bodies(listing):
            loop_top = ", ".join(f"{op} {n}" for op, n in list(body.items())[: args.top])
            print(f"  loop body: {sum(body.values())} instructions: {loop_top}")
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{launch.kernel}.sass").write_text(listing)


if __name__ == "__main__":
    main()
