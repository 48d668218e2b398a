"""Per-module weight hooks (contract v2): layouts the bucket map cannot express, loaded strictly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from flashrec_core.loader import CheckpointError, load_weights
from flashrec_core.spec import (
    BaseModelSpec,
    ModelConfig,
    RopeConfig,
    WeightHook,
    WeightMap,
)

EXPERTS, HIDDEN, INTER = 3, 4, 6


class StackedExperts(nn.Module):
    """Per-expert gate/up tensors stacked into [E, 2I, H]; down stored transposed as [E, H, I]."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(EXPERTS, 2 * INTER, HIDDEN), False)
        self.down_t = nn.Parameter(torch.empty(EXPERTS, INTER, HIDDEN), False)

    def checkpoint_tensors(self) -> Sequence[str]:
        return [f"{e}.{p}.weight" for e in range(EXPERTS) for p in ("gate", "up", "down")]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        expert, proj, _ = name.split(".")
        e = int(expert)
        if proj == "down":
            self.down_t.data[e] = tensor.t()  # checkpoint [H, I] -> [I, H]
            return
        if tensor.shape != (INTER, HIDDEN):
            raise ValueError(f"expected {(INTER, HIDDEN)}, got {tuple(tensor.shape)}")
        rows = slice(0, INTER) if proj == "gate" else slice(INTER, 2 * INTER)
        self.gate_up.data[e, rows] = tensor


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(HIDDEN), False)
        self.experts = StackedExperts()


CONFIG = ModelConfig(
    architecture="ToyForCausalLM", vocab_size=8, hidden_size=HIDDEN, num_layers=1, num_q_heads=1,
    num_kv_heads=1, head_dim=4, intermediate_size=INTER, max_position=8,
    tie_word_embeddings=False, rope=RopeConfig(theta=1e4, rotary_dim=4), norm_eps=1e-6,
)  # fmt: skip
SPEC = BaseModelSpec(
    name="toy", architectures=("ToyForCausalLM",), config_parser=lambda hf: CONFIG,
    weight_map=WeightMap(), model_class="x:Y",
)  # fmt: skip


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"norm.weight": torch.randn(HIDDEN, generator=gen)}
    for e in range(EXPERTS):
        for p in ("gate", "up"):
            out[f"experts.{e}.{p}.weight"] = torch.randn(INTER, HIDDEN, generator=gen)
        out[f"experts.{e}.down.weight"] = torch.randn(HIDDEN, INTER, generator=gen)
    return out


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_hook_module_satisfies_the_protocol() -> None:
    assert isinstance(StackedExperts(), WeightHook)


def test_hook_loads_stacked_and_transposed_tensors(tmp_path: Path) -> None:
    tensors = _tensors()
    model = Toy()
    load_weights(model, SPEC, CONFIG, _write(tmp_path / "c", tensors), show_progress=False)
    for e in range(EXPERTS):
        gate_up = model.experts.gate_up[e]
        assert torch.equal(gate_up[:INTER], tensors[f"experts.{e}.gate.weight"])
        assert torch.equal(gate_up[INTER:], tensors[f"experts.{e}.up.weight"])
        assert torch.equal(model.experts.down_t[e], tensors[f"experts.{e}.down.weight"].t())
    assert torch.equal(model.norm.weight, tensors["norm.weight"])


def test_hook_missing_tensor_is_named(tmp_path: Path) -> None:
    tensors = _tensors()
    del tensors["experts.2.up.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors .*experts\.2\.up\.weight"):
        load_weights(Toy(), SPEC, CONFIG, _write(tmp_path / "c", tensors), show_progress=False)


def test_hook_unexpected_tensor_is_named(tmp_path: Path) -> None:
    tensors = {**_tensors(), "experts.9.gate.weight": torch.zeros(INTER, HIDDEN)}
    with pytest.raises(CheckpointError, match=r"experts\.9\.gate\.weight.*weight hook reads only"):
        load_weights(Toy(), SPEC, CONFIG, _write(tmp_path / "c", tensors), show_progress=False)


def test_hook_error_names_file_and_tensor(tmp_path: Path) -> None:
    tensors = {**_tensors(), "experts.1.gate.weight": torch.zeros(INTER + 1, HIDDEN)}
    path = _write(tmp_path / "c", tensors)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'experts\.1\.gate"):
        load_weights(Toy(), SPEC, CONFIG, path, show_progress=False)
