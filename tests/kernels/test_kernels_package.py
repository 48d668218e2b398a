"""Package contract: importable without triton, public names exported, clear device errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flashrec_kernels
from flashrec_kernels.device import check_triton_device
from flashrec_kernels.testing import ulp_distance


def test_import_does_not_import_triton() -> None:
    code = "import flashrec_kernels, sys; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_kernel_has_a_reference() -> None:
    names = set(flashrec_kernels.__all__)
    kernels = {
        "per_token_quant_fp8",
        "rms_norm_quant_fp8",
        "silu_mul_quant_fp8",
        "rope_norm_store",
        "trie_topk",
        "beam_cascade_attention",
        "copy_kv_rows",
    }
    assert {f"{k}_ref" for k in kernels} | kernels <= names
    assert all(hasattr(flashrec_kernels, name) for name in names)


def test_triton_available_follows_device_and_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not flashrec_kernels.triton_available("cpu")
    with pytest.raises(RuntimeError, match="per_token_quant_fp8_ref"):
        flashrec_kernels.per_token_quant_fp8(torch.zeros(2, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    has_triton = subprocess.run([sys.executable, "-c", "import triton"]).returncode == 0
    assert flashrec_kernels.triton_available("cpu") == has_triton
    check_triton_device(torch.zeros(1), "any_kernel")  # no raise under the interpreter


def test_ulp_distance_counts_representable_steps() -> None:
    a = torch.tensor([1.0, -1.0, 0.0, 448.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([1.125, -1.125, -0.0, -448.0]).to(torch.float8_e4m3fn)
    # 1 -> 1.125 is one e4m3 step; +0 and -0 are the same point; 448 -> -448 crosses 2 * 126 codes.
    assert ulp_distance(a, b).tolist() == [1, 1, 0, 252]
