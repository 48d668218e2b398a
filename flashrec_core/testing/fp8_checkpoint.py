"""Synthesize an FP8 checkpoint (e4m3 weights + per-channel scales) from a float one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flashrec_core.layers import Linear, quantize_weight_per_channel
from flashrec_core.loader.weights import WeightLoader
from flashrec_core.spec import ModelConfig, ModelSpec


def write_fp8_checkpoint(
    src: Path, dst: Path, spec: ModelSpec, config: ModelConfig, model: torch.nn.Module,
    *, per_tensor: bool = False,
) -> list[str]:  # fmt: skip
    """Quantize every tensor that the spec maps onto a Linear weight; copy everything else.

    `model` (any build of the same config) tells which checkpoint names land on a Linear.
    Returns the quantized names. per_tensor=True writes one scale per tensor instead of per row.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    loader = WeightLoader(model, spec, config)
    modules = dict(model.named_modules())
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    quantized = []
    for name, t in tensors.items():
        target = loader.target(name)
        if target.kind == "weight" and isinstance(modules.get(target.module), Linear):
            q, scale = _quantize(t, per_tensor)
            out[name] = q
            out[name.removesuffix(".weight") + ".weight_scale"] = scale
            quantized.append(name)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config_json = json.loads((src / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config_json, indent=2))
    return quantized


def _quantize(t: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not per_tensor:
        q, scale = quantize_weight_per_channel(t)
        return q, scale[:, None]  # [out, 1], the layout many FP8 exports use
    scale = t.float().abs().max().clamp(min=1e-12) / 448.0
    return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(1)
