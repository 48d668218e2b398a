"""The Triton kernels compile for an H100/H200 (sm_90) here, with no GPU: Triton's own compiler
and ptxas produce the cubin. The interpreter never compiles, so without this a kernel can pass
every CPU test and still fail to build on the device (it happened to the RoPE kernel once).

Runs in a subprocess: under TRITON_INTERPRET=1 (set for these tests) `@triton.jit` makes
interpreted functions, which cannot be compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flashrec_kernels import triton_beam_attention as m

    kv, head_dim, group = {kv!r}, {head_dim}, {group}
    fn = m._beam_cascade_attention_kernel
    names = fn.arg_names
    pointers = {{
        "q_ptr": "*bf16", "o_ptr": "*bf16", "k_cache_ptr": "*" + kv, "v_cache_ptr": "*" + kv,
        "prefix_indptr_ptr": "*i32", "prefix_idx_ptr": "*i32", "row_indptr_ptr": "*i32",
        "suffix_ptr": "*i32", "qk_scale": "fp32",
    }}
    consts = dict(GROUP=group, S=2, D=head_dim, BLOCK_M=m.BLOCK_M[head_dim], BLOCK_N=m.BLOCK_N,
                  INTERPRET=False)
    signature = {{n: pointers.get(n, "i32") for n in names}}
    signature.update({{n: "constexpr" for n in consts}})
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={{(names.index(n),): v for n, v in consts.items()}})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES))
    assert kernel.asm["cubin"], "no cubin"
    assert "wgmma" in kernel.asm["ptx"], "the prompt chunks should use Hopper tensor cores"
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("kv", "head_dim", "group"), [("fp8e4nv", 128, 2), ("bf16", 64, 1), ("bf16", 128, 4)]
)
def test_beam_cascade_attention_compiles_for_sm90(kv: str, head_dim: int, group: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = _SCRIPT.format(kv=kv, head_dim=head_dim, group=group)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
