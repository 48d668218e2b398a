"""The strict, streaming weight loader on tiny Qwen3 checkpoints written by transformers."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

import flashrec_models_qwen3
from flashrec_core.layers import FP8_DTYPE
from flashrec_core.loader import Checkpoint, CheckpointError
from flashrec_core.testing.checkpoint import write_tiny_checkpoint
from flashrec_core.testing.oracle import create_runner

TIED = flashrec_models_qwen3.spec.examples[0].hf_config  # tied embeddings, GQA 4q/2kv
UNTIED = flashrec_models_qwen3.spec.examples[1].hf_config
L0 = "model.layers.0"
FP8_MAX = 448.0

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tied")
    write_tiny_checkpoint(path, TIED)
    return path


@pytest.fixture(scope="module")
def untied_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("untied")
    write_tiny_checkpoint(path, UNTIED)
    return path


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bf16")
    write_tiny_checkpoint(path, UNTIED, dtype=torch.bfloat16)
    return path


def _runner(path: Path, **overrides):
    return create_runner(path, kv_cache_tokens=64, max_requests=2, **overrides)


def _edited(src: Path, dst: Path, edit: Callable[[Tensors], None]) -> Path:
    """Copy a checkpoint dir; rewrite its model.safetensors through `edit` (mutates a dict)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _load_error(path: Path, **overrides) -> str:
    with pytest.raises(CheckpointError) as info:
        _runner(path, **overrides)
    return str(info.value)


def _params(runner) -> dict[str, torch.Tensor]:
    return dict(runner.model.named_parameters())


def test_missing_tensor_is_named(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.self_attn.q_norm.weight"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.pop(name))
    msg = _load_error(path)
    assert f"lacks 1 tensors expected by Qwen3ForCausalLM: {name}" in msg
    assert str(path) in msg


def test_missing_bucket_shard_is_named_by_checkpoint_key(tied_ckpt: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.pop(name))
    msg = _load_error(path)
    assert f"lacks 1 tensors expected by Qwen3ForCausalLM: {name}" in msg


def test_missing_untied_lm_head_is_named_by_checkpoint_key(
    untied_ckpt: Path, tmp_path: Path
) -> None:
    path = _edited(untied_ckpt, tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    msg = _load_error(path)
    assert "lacks 1 tensors expected by Qwen3ForCausalLM: lm_head.weight" in msg


def test_extra_unknown_tensor_is_named(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.mlp.extra_proj.weight"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({name: torch.zeros(4, 4)}))
    msg = _load_error(path)
    assert f"tensor '{name}'" in msg and "model.safetensors" in msg
    assert "does not have" in msg and "ignore rule" in msg


def test_ignored_tensor_is_read_past(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.self_attn.rotary_emb.inv_freq"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({name: torch.ones(8)}))
    runner = _runner(path)
    reference = load_file(str(tied_ckpt / "model.safetensors"))
    assert torch.equal(_params(runner)["model.norm.weight"], reference["model.norm.weight"])


def test_wrong_shape_names_tensor_and_shapes(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.self_attn.k_proj.weight"  # expected (2 kv heads * 16, 64)
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({name: torch.zeros(16, 64)}))
    msg = _load_error(path)
    assert f"tensor '{name}' has shape (16, 64); expected (32, 64)" in msg
    assert f"shard 1 of {L0}.self_attn.qkv_proj.weight" in msg


def _shard(src: Path, dst: Path, *, with_index: bool = True) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for fname, part in files.items():
        save_file({n: tensors[n] for n in part}, str(dst / fname))
    if with_index:
        weight_map = {n: fname for fname, part in files.items() for n in part}
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("with_index", [True, False], ids=["index", "glob"])
def test_sharded_checkpoint_loads_like_single_file(
    untied_ckpt: Path, tmp_path: Path, with_index: bool
) -> None:
    path = _shard(untied_ckpt, tmp_path / "c", with_index=with_index)
    with Checkpoint(path) as ckpt:
        assert {p.name for p in ckpt.files.values()} == {
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        }  # fmt: skip
    single, sharded = _params(_runner(untied_ckpt)), _params(_runner(path))
    assert single.keys() == sharded.keys()
    for name, p in single.items():
        assert torch.equal(p, sharded[name]), name


def test_missing_shard_named_in_index(untied_ckpt: Path, tmp_path: Path) -> None:
    path = _shard(untied_ckpt, tmp_path / "c")
    (path / "model-00002-of-00002.safetensors").unlink()
    msg = _load_error(path)
    assert "model.safetensors.index.json" in msg
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg


def test_int_tensor_is_a_dtype_error(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.input_layernorm.weight"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({name: t[name].to(torch.int32)}))
    msg = _load_error(path)
    assert f"tensor '{name}' has dtype torch.int32" in msg


def test_fp8_weight_without_scale(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.mlp.down_proj.weight"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({name: t[name].to(FP8_DTYPE)}))
    msg = _load_error(path)
    assert f"tensor '{name}' is float8_e4m3fn but has no weight_scale(_inv) tensor" in msg


def test_scale_with_wrong_number_of_values(tied_ckpt: Path, tmp_path: Path) -> None:
    name = f"{L0}.mlp.down_proj.weight"  # 64 output channels

    def edit(t: Tensors) -> None:
        t[name] = t[name].to(FP8_DTYPE)
        t[f"{L0}.mlp.down_proj.weight_scale"] = torch.ones(3)

    msg = _load_error(_edited(tied_ckpt, tmp_path / "c", edit))
    assert f"'{L0}.mlp.down_proj.weight_scale' has 3 values" in msg
    assert "expected 1 (per-tensor) or 64 (per-channel)" in msg


def test_scale_without_fp8_weight(tied_ckpt: Path, tmp_path: Path) -> None:
    scale = f"{L0}.mlp.down_proj.weight_scale"
    path = _edited(tied_ckpt, tmp_path / "c", lambda t: t.update({scale: torch.ones(64)}))
    msg = _load_error(path)
    assert f"scale tensor '{scale}' has no FP8 weight" in msg


def test_tied_checkpoint_with_lm_head_copy_loads(tied_ckpt: Path, tmp_path: Path) -> None:
    def edit(t: Tensors) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    runner = _runner(_edited(tied_ckpt, tmp_path / "c", edit))
    embed = runner.model.model.embed_tokens.weight
    assert runner.model.lm_head().data_ptr() == embed.data_ptr()
    reference = load_file(str(tied_ckpt / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(runner.model.lm_head(), reference)


def test_bf16_checkpoint_quantizes_per_channel_on_load(bf16_ckpt: Path) -> None:
    runner = _runner(bf16_ckpt, quantization="fp8")
    ckpt = load_file(str(bf16_ckpt / "model.safetensors"))
    modules = dict(runner.model.named_modules())
    fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }
    for layer in ("model.layers.0", "model.layers.1"):
        for param, sources in fused.items():
            module = modules[f"{layer}.{param}"]
            w = torch.cat([ckpt[f"{layer}.{s}.weight"] for s in sources]).float()
            scale = w.abs().amax(dim=1) / FP8_MAX
            assert module.weight.dtype == FP8_DTYPE
            assert torch.equal(module.weight_scale, scale), f"{layer}.{param} scales"
            expected = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            assert torch.equal(module.weight.view(torch.uint8), expected.view(torch.uint8))
    # non-Linear parameters keep full precision (exact bf16 values)
    norm = _params(runner)["model.norm.weight"]
    assert torch.equal(norm, ckpt["model.norm.weight"].float())


def _quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
    scale = amax.float() / FP8_MAX
    q = (w / (scale if per_tensor else scale[:, None])).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@pytest.fixture(scope="module")
def fp8_ckpt(untied_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tensors]:
    """Layer weights as e4m3 with three scale layouts: [out, 1] per-channel `weight_scale`,
    a 0-d per-tensor `weight_scale`, and an [out] per-channel `weight_scale_inv`."""
    dst = tmp_path_factory.mktemp("fp8") / "c"
    layouts = {
        "self_attn.q_proj": ("weight_scale", False, (-1, 1)),
        "self_attn.k_proj": ("weight_scale", True, ()),
        "self_attn.v_proj": ("weight_scale_inv", False, (-1,)),
        "self_attn.o_proj": ("weight_scale", True, (1,)),
        "mlp.gate_proj": ("weight_scale", False, (-1, 1)),
        "mlp.up_proj": ("weight_scale_inv", True, ()),
        "mlp.down_proj": ("weight_scale", False, (-1,)),
    }

    def edit(t: Tensors) -> None:
        for layer in ("model.layers.0", "model.layers.1"):
            for proj, (suffix, per_tensor, shape) in layouts.items():
                q, scale = _quantize(t[f"{layer}.{proj}.weight"], per_tensor)
                t[f"{layer}.{proj}.weight"] = q
                t[f"{layer}.{proj}.{suffix}"] = scale.reshape(shape).contiguous()

    _edited(untied_ckpt, dst, edit)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, load_file(str(dst / "model.safetensors"))


def _rows(tensors: Tensors, layer: str, sources: tuple[str, ...], dequant: bool) -> torch.Tensor:
    parts = []
    for s in sources:
        q = tensors[f"{layer}.{s}.weight"]
        scale = tensors.get(
            f"{layer}.{s}.weight_scale", tensors.get(f"{layer}.{s}.weight_scale_inv")
        )
        scale = (
            scale.float().flatten().expand(q.shape[0]) if scale.numel() == 1 else scale.flatten()
        )
        parts.append(q.float() * scale[:, None] if dequant else scale)
    return torch.cat(parts)


def test_fp8_checkpoint_with_quantization_none_dequantizes(fp8_ckpt) -> None:
    path, tensors = fp8_ckpt
    runner = _runner(path, quantization="none", dtype="float32")
    params = _params(runner)
    assert all(p.dtype == torch.float32 for p in params.values())
    for layer in ("model.layers.0", "model.layers.1"):
        qkv = params[f"{layer}.self_attn.qkv_proj.weight"]
        sources = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        assert torch.equal(qkv, _rows(tensors, layer, sources, dequant=True))
        gate_up = params[f"{layer}.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up, _rows(tensors, layer, ("mlp.gate_proj", "mlp.up_proj"), True))
        down = params[f"{layer}.mlp.down_proj.weight"]
        assert torch.equal(down, _rows(tensors, layer, ("mlp.down_proj",), True))


def test_fp8_checkpoint_loads_stored_bytes_and_scales(fp8_ckpt) -> None:
    path, tensors = fp8_ckpt
    runner = _runner(path)  # quantization_config alone turns FP8 on
    assert runner.config.quantization is not None
    modules = dict(runner.model.named_modules())
    for layer in ("model.layers.0", "model.layers.1"):
        module = modules[f"{layer}.self_attn.qkv_proj"]
        sources = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        stored = torch.cat([tensors[f"{layer}.{s}.weight"] for s in sources])
        assert torch.equal(module.weight.view(torch.uint8), stored.view(torch.uint8))
        assert torch.equal(module.weight_scale, _rows(tensors, layer, sources, dequant=False))
        up_scale = tensors[f"{layer}.mlp.up_proj.weight_scale_inv"].float()
        gate_up_scale = modules[f"{layer}.mlp.gate_up_proj"].weight_scale
        assert torch.all(gate_up_scale[128:] == up_scale), "per-tensor scale broadcast to rows"


def test_loader_streams_each_tensor_once(
    untied_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    original = Checkpoint.get

    def counting_get(self: Checkpoint, name: str) -> torch.Tensor:
        calls[name] += 1
        return original(self, name)

    def no_bulk_load(*args, **kwargs):
        raise AssertionError("the loader must stream tensors, not load whole files")

    monkeypatch.setattr(Checkpoint, "get", counting_get)
    monkeypatch.setattr(safetensors.torch, "load_file", no_bulk_load)
    monkeypatch.setattr(safetensors.torch, "load", no_bulk_load)
    _runner(untied_ckpt)
    monkeypatch.undo()
    names = load_file(str(untied_ckpt / "model.safetensors")).keys()
    assert calls == Counter(dict.fromkeys(names, 1))


def test_fp8_checkpoint_modules_to_not_convert_stay_unquantized(fp8_ckpt, tmp_path: Path) -> None:
    src, _ = fp8_ckpt
    name = f"{L0}.mlp.down_proj"
    original = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))

    def edit(t: Tensors) -> None:
        t.pop(f"{name}.weight_scale")
        t[f"{name}.weight"] = original.clone()

    path = _edited(src, tmp_path / "c", edit)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [name]
    (path / "config.json").write_text(json.dumps(config))
    try:
        runner = _runner(path)
    except (CheckpointError, ValueError) as exc:
        assert "modules_to_not_convert" in str(exc) or name in str(exc)
        return
    weight = dict(runner.model.named_modules())[name].weight
    assert weight.dtype != FP8_DTYPE, f"{name} was quantized although the config excludes it"
    assert torch.equal(weight.float(), original)


def test_duplicate_tensor_across_unindexed_shards_is_an_error(
    untied_ckpt: Path, tmp_path: Path
) -> None:
    path = _shard(untied_ckpt, tmp_path / "c", with_index=False)
    name = "model.norm.weight"
    first = path / "model-00001-of-00002.safetensors"
    second = path / "model-00002-of-00002.safetensors"
    holder, other = (first, second) if name in load_file(str(first)) else (second, first)
    tensors = load_file(str(other))
    tensors[name] = torch.zeros(64)
    save_file(tensors, str(other))
    try:
        _runner(path)
    except CheckpointError as exc:
        assert name in str(exc) and holder.name in str(exc) and other.name in str(exc)
        return
    raise AssertionError(f"'{name}' is in both {holder.name} and {other.name}; loaded silently")
