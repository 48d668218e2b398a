"""`pdl_launch` (flashrec_kernels/pdl.py): which launches get programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flashrec_kernels.pdl import pdl_launch  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "value,mode", [(None, 0), ("", 0), ("0", 0), ("1", 1), ("2", 2), ("3", 3), ("yes", 0), ("4", 0)]
)
def test_the_variable_picks_the_mode_for_compiled_launches(
    monkeypatch: pytest.MonkeyPatch, value: str | None, mode: int
) -> None:
    # a CPU tensor outside the interpreter is gpu_compile's compile-only launch (sm_90)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if value is None:
        monkeypatch.delenv("FLASHREC_PDL", raising=False)
    else:
        monkeypatch.setenv("FLASHREC_PDL", value)
    assert pdl_launch(CPU) == {"USE_GDC": mode, "launch_pdl": mode > 0}


def test_the_interpreter_never_launches_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreter has no griddepcontrol: its kernels run as they always did
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHREC_PDL", "2")
    assert pdl_launch(CPU) == {"USE_GDC": 0, "launch_pdl": False}
