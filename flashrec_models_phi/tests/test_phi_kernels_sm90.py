"""Phi's own Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU
(`flashrec_kernels.gpu_compile`): the interpreter-run CPU tests never compile them; and they
spill no registers (local-memory traffic in kernels meant to run at bandwidth)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

_SCRIPT = """
import torch
from flashrec_kernels.gpu_compile import compiled_launches
from flashrec_models_phi.kernels import triton_gelu, triton_layer_norm

x = torch.zeros(4, 2560, dtype=torch.bfloat16)
w = torch.ones(2560, dtype=torch.bfloat16)
with compiled_launches(90) as done:
    triton_gelu.launch_gelu_tanh_quant_fp8(torch.zeros(4, 10240, dtype=torch.bfloat16))
    triton_layer_norm.launch_layer_norm_quant_fp8(x, w, w.clone(), 1e-5, x.clone())
    triton_layer_norm.launch_layer_norm_quant_fp8(x, w, None, 1e-5, None)
assert all(c.cubin_bytes > 0 for c in done)
spilled = [(c.kernel, c.registers, c.spill_bytes) for c in done if c.spill_bytes]
assert not spilled, f"register spills (kernel, registers, bytes): {spilled}"
print("compiled", sorted({c.kernel for c in done}))
"""


def test_phi_kernels_compile_for_sm90() -> None:
    from flashrec_kernels.gpu_compile import run_compile_script

    proc = run_compile_script(_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "_gelu_tanh_quant_fp8_kernel" in proc.stdout
    assert "_layer_norm_quant_fp8_kernel" in proc.stdout
