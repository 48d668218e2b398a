"""The generic, spec-driven weight loader.

Streams a safetensors checkpoint tensor by tensor into a model built with empty parameters. The
spec's `WeightMap` says which checkpoint tensors merge into one fused parameter (along the output
dim, at the offsets of the module's `output_sizes`), what is renamed, ignored or tied. FP8 weights
keep their scales (concatenated per output channel, never requantized); BF16 weights are
quantized per output channel when the model was built with FP8 linears. Strict: every parameter
is loaded exactly once and every checkpoint tensor is used or explicitly ignored.

Layouts that are not a concatenation along the output dim (stacked experts, transposed or split
tensors) belong to a module with a weight hook (contract v2, `flashrec_core.spec.WeightHook`):
every checkpoint tensor under that module goes to its `load_checkpoint_tensor`, and the loader
checks that the hook received exactly the names its `checkpoint_tensors()` lists.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flashrec_core.layers.linear import Linear
from flashrec_core.layers.quant import FP8_DTYPE, quantize_weight_per_channel
from flashrec_core.loader.checkpoint import Checkpoint, CheckpointError
from flashrec_core.spec import ModelConfig, ModelSpec

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter name, row range (shard), and its kind."""

    param: str
    module: str
    kind: str  # "weight" | "bias" | other attribute name
    shard: int
    num_shards: int


@dataclass(frozen=True)
class LoadReport:
    num_tensors: int
    num_ignored: int
    bytes_read: int
    seconds: float


class WeightLoader:
    """Maps checkpoint names to parameters by the spec's WeightMap and copies them in."""

    def __init__(self, model: nn.Module, spec: ModelSpec, config: ModelConfig) -> None:
        self.model = model
        self.spec = spec
        self.config = config
        self.wmap = spec.weight_map
        self.ignore = [re.compile(p) for p in self.wmap.ignore]
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.tied = {p for p, _ in self.wmap.tied} if config.tie_word_embeddings else set()
        self.loaded: dict[tuple[str, int], str] = {}
        self.hooks = {
            name: m for name, m in self.modules.items() if hasattr(m, "load_checkpoint_tensor")
        }
        self.hooked: dict[str, dict[str, str]] = {name: {} for name in self.hooks}
        """hook module -> {relative name it received: checkpoint name}"""

    def _rename(self, name: str) -> str:
        for old, new in self.wmap.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def hook_for(self, name: str) -> tuple[str, str] | None:
        """(hook module, name relative to it) when a weight hook loads checkpoint tensor `name`."""
        if not self.hooks:
            return None
        mapped = self._rename(name)
        parts = mapped.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in self.hooks:
                return module, ".".join(parts[cut:])
        return None

    def target(self, name: str) -> Target:
        """The destination of checkpoint tensor `name` after renames and bucket merges."""
        mapped = self._rename(name)
        module, _, kind = mapped.rpartition(".")
        for bucket in self.wmap.buckets:
            for shard, source in enumerate(bucket.sources):
                if module == source or module.endswith("." + source):
                    prefix = module[: len(module) - len(source)]
                    fused = prefix + bucket.param
                    return Target(f"{fused}.{kind}", fused, kind, shard, len(bucket.sources))
        return Target(mapped, module, kind, 0, 1)

    def is_ignored(self, name: str) -> bool:
        return any(p.fullmatch(name) for p in self.ignore)

    def load(self, ckpt: Checkpoint, show_progress: bool = True) -> LoadReport:
        start = time.perf_counter()
        names = [n for n in ckpt.iter_names() if not n.endswith(SCALE_SUFFIXES)]
        scales = {n for n in ckpt.keys() if n.endswith(SCALE_SUFFIXES)}
        ignored = 0
        used_scales: set[str] = set()
        for name in ckpt.keys():
            hooked = self.hook_for(name)
            if hooked is not None and not self.is_ignored(name):
                self._load_hooked(ckpt, name, *hooked)
        for name in _progress(names, ckpt, show_progress):
            if self.is_ignored(name):
                ignored += 1
                continue
            if self.hook_for(name) is not None:
                continue
            target = self.target(name)
            if target.param in self.tied:
                continue
            self._load_one(ckpt, name, target, used_scales)
        for name in sorted(scales - used_scales):
            if self.hook_for(name) is not None:
                continue
            if not self.is_ignored(name):
                raise CheckpointError(
                    f"{ckpt.file_of(name)}: scale tensor '{name}' has no FP8 weight to go with"
                )
            ignored += 1
        self._check_complete(ckpt)
        seconds = time.perf_counter() - start
        return LoadReport(len(names), ignored, ckpt.total_bytes(), seconds)

    def _load_hooked(self, ckpt: Checkpoint, name: str, module: str, rel: str) -> None:
        where = f"{ckpt.file_of(name)}: tensor '{name}'"
        hook = self.hooks[module]
        expected = set(hook.checkpoint_tensors())
        if rel not in expected:
            raise CheckpointError(
                f"{where} is under '{module}', whose weight hook reads only "
                f"{sorted(expected)[:6]}; remove the tensor or add an ignore rule to the spec"
            )
        if rel in self.hooked[module]:
            raise CheckpointError(f"{where} loads '{module}.{rel}' again")
        self.hooked[module][rel] = name
        try:
            hook.load_checkpoint_tensor(rel, ckpt.get(name))
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{where}: the weight hook of '{module}' failed: {exc}") from exc

    def _load_one(self, ckpt: Checkpoint, name: str, target: Target, used: set[str]) -> None:
        where = f"{ckpt.file_of(name)}: tensor '{name}'"
        param = self.params.get(target.param)
        if param is None:
            raise CheckpointError(
                f"{where} maps to '{target.param}', which {self.spec.name} does not have; "
                "remove it from the checkpoint or add an ignore rule to the spec's weight map"
            )
        key = (target.param, target.shard)
        if key in self.loaded:
            raise CheckpointError(
                f"{where} loads '{target.param}' again (first: {self.loaded[key]})"
            )
        self.loaded[key] = name
        tensor = ckpt.get(name)
        if tensor.dtype not in (*FLOAT_DTYPES, FP8_DTYPE):
            raise CheckpointError(
                f"{where} has dtype {tensor.dtype}; expected a float or fp8 dtype"
            )
        module = self.modules[target.module]
        rows = _shard_rows(module, target, param)
        if tensor.dtype == FP8_DTYPE:
            scale = self._scale_for(ckpt, name, tensor, where, used)
        else:
            scale = None
        _check_shape(where, target, param, rows, tensor)
        self._copy(module, param, target, rows, tensor.to(param.device), scale, where)

    def _scale_for(
        self, ckpt: Checkpoint, name: str, tensor: torch.Tensor, where: str, used: set[str]
    ) -> torch.Tensor:
        base = name.removesuffix(".weight")
        for suffix in SCALE_SUFFIXES:
            if base + suffix in ckpt:
                used.add(base + suffix)
                scale = ckpt.get(base + suffix).float().flatten()
                if scale.numel() == 1:
                    return scale.expand(tensor.shape[0]).clone()
                if scale.numel() != tensor.shape[0]:
                    raise CheckpointError(
                        f"{ckpt.file_of(base + suffix)}: '{base + suffix}' has {scale.numel()} "
                        f"values; expected 1 (per-tensor) or {tensor.shape[0]} (per-channel)"
                    )
                return scale
        raise CheckpointError(f"{where} is float8_e4m3fn but has no weight_scale(_inv) tensor")

    def _copy(
        self,
        module: nn.Module,
        param: torch.Tensor,
        target: Target,
        rows: slice,
        tensor: torch.Tensor,
        scale: torch.Tensor | None,
        where: str,
    ) -> None:
        fp8_param = param.dtype == FP8_DTYPE
        if isinstance(module, Linear) and target.kind == "weight" and fp8_param:
            if scale is None:  # BF16 checkpoint, FP8 requested: quantize on load
                tensor, scale = quantize_weight_per_channel(tensor)
            assert module.weight_scale is not None, "an FP8 Linear has a scale"
            module.weight_scale.data[rows] = scale.to(param.device)
            param.data[rows] = tensor
            return
        if fp8_param:
            raise CheckpointError(f"{where}: FP8 parameter '{target.param}' is not a Linear weight")
        if scale is not None:  # FP8 checkpoint, higher-precision model: dequantize
            tensor = tensor.float() * scale.to(tensor.device)[:, None]
        param.data[rows] = tensor.to(param.dtype)

    def _check_complete(self, ckpt: Checkpoint) -> None:
        missing = []
        for module, hook in self.hooks.items():
            got = self.hooked[module]
            missing += [f"{module}.{r}" for r in hook.checkpoint_tensors() if r not in got]
        for pname in self.params:
            if pname in self.tied or pname.endswith(".weight_scale"):
                continue
            if any(pname.startswith(m + ".") for m in self.hooks):
                continue
            module_name, _, kind = pname.rpartition(".")
            module = self.modules[module_name]
            shards = len(module.output_sizes) if isinstance(module, Linear) else 1
            for shard in range(shards):
                if (pname, shard) not in self.loaded:
                    missing.append(self._source_name(pname, shard))
        if missing:
            shown = ", ".join(missing[:8]) + (", …" if len(missing) > 8 else "")
            raise CheckpointError(
                f"checkpoint {ckpt.root} lacks {len(missing)} tensors expected by "
                f"{self.config.architecture}: {shown}"
            )

    def _source_name(self, pname: str, shard: int) -> str:
        """The checkpoint name a parameter shard is read from (for error messages)."""
        module, _, kind = pname.rpartition(".")
        for bucket in self.wmap.buckets:
            if module == bucket.param or module.endswith("." + bucket.param):
                prefix = module[: len(module) - len(bucket.param)]
                module = prefix + bucket.sources[shard]
                break
        name = f"{module}.{kind}"
        for old, new in self.wmap.renames:
            if name.startswith(new):
                return old + name[len(new) :]
        return name


def _shard_rows(module: nn.Module, target: Target, param: torch.Tensor) -> slice:
    if target.num_shards == 1:
        return slice(0, param.shape[0])
    sizes = getattr(module, "output_sizes", None)
    assert sizes is not None and len(sizes) == target.num_shards, (
        f"{target.module} must be a fused Linear with {target.num_shards} output_sizes"
    )
    start = sum(sizes[: target.shard])
    return slice(start, start + sizes[target.shard])


def _check_shape(
    where: str, target: Target, param: torch.Tensor, rows: slice, tensor: torch.Tensor
) -> None:
    expected = (rows.stop - rows.start, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        part = f" (shard {target.shard} of {target.param})" if target.num_shards > 1 else ""
        raise CheckpointError(
            f"{where} has shape {tuple(tensor.shape)}; expected {expected}{part}; "
            "is config.json for this checkpoint?"
        )


def _progress(names: list[str], ckpt: Checkpoint, show: bool):
    if not show:
        return names
    from tqdm import tqdm

    # NOTE: delay keeps small loads silent; the bar appears only for loads over a few seconds.
    return tqdm(names, desc=f"loading {Path(ckpt.root).name}", unit="tensor", delay=3.0)


def load_weights(
    model: nn.Module,
    spec: ModelSpec,
    config: ModelConfig,
    model_path: str | Path,
    *,
    show_progress: bool = True,
) -> LoadReport:
    """Load a checkpoint directory into `model` strictly; see the module docstring."""
    with Checkpoint(model_path) as ckpt, torch.no_grad():
        return WeightLoader(model, spec, config).load(ckpt, show_progress)
