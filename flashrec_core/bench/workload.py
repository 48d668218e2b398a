"""Synthetic benchmark workloads: a random-weight model of a real shape, a random catalog,
requests with a shared prefix. Nothing is read from disk; throughput does not depend on weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrec_core.config import EngineConfig, resolve_engine_config
from flashrec_core.engine.build import LoadedModel, create_build_context
from flashrec_core.engine.requests import GenerationRequest
from flashrec_core.layers import FP8_DTYPE, Linear, quantize_weight_per_channel
from flashrec_core.registry import Registry
from flashrec_core.search.sid_layout import SidLayout


def bench_presets() -> dict[str, dict[str, Any]]:
    """Model shapes offered by the installed plugins (spec.metadata["bench_presets"])."""
    presets: dict[str, dict[str, Any]] = {}
    for plugin in Registry.discover().plugins:
        if plugin.spec is not None:
            presets.update(getattr(plugin.spec, "metadata", {}).get("bench_presets", {}))
    return presets


def load_shape(preset: str | None, config_path: str | None) -> dict[str, Any]:
    """An HF config dict: from --config, or a preset shipped by an installed plugin."""
    if config_path:
        return json.loads(Path(config_path).read_text())
    presets = bench_presets()
    if preset not in presets:
        raise ValueError(
            f"unknown bench preset {preset!r}; installed plugins offer: "
            f"{', '.join(sorted(presets)) or 'none'} (or pass --config config.json)"
        )
    return dict(presets[preset])


def sid_layout_at_end(vocab_size: int, level_sizes: tuple[int, ...]) -> SidLayout:
    """SID codebooks as the last tokens of the vocabulary, then <|sid_begin|>, <|sid_end|>."""
    start = vocab_size - sum(level_sizes) - 2
    if start < 0:
        raise ValueError(f"vocab_size {vocab_size} cannot hold SID levels {level_sizes}")
    starts = tuple(start + sum(level_sizes[:i]) for i in range(len(level_sizes)))
    names = tuple("abcde"[i] for i in range(len(level_sizes)))
    return SidLayout(names, starts, level_sizes, vocab_size - 2, vocab_size - 1)


@torch.no_grad()
def random_model(
    hf_config: dict[str, Any], engine_config: EngineConfig, seed: int = 0
) -> LoadedModel:
    """Build the architecture's model with random weights (std 0.02, norms 1) on the device."""
    spec = Registry.discover().resolve(hf_config["architectures"][0])
    config = spec.parse_config(hf_config)
    cfg = resolve_engine_config(engine_config, checkpoint_quantized=False, head_dim=config.head_dim)
    ctx, fused = create_build_context(spec, cfg)
    with torch.device(ctx.device):
        model = spec.load_model_class()(config, ctx)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, Linear) and module.fp8:
            w = torch.randn(module.weight.shape, generator=gen, device=ctx.device) * 0.02
            q, scale = quantize_weight_per_channel(w)
            module.weight.copy_(q)
            assert module.weight_scale is not None, "FP8 Linear has a scale"
            module.weight_scale.copy_(scale)
    for name, p in model.named_parameters():
        if p.dtype == FP8_DTYPE or name.endswith("weight_scale"):
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=ctx.device) * 0.02)
    return LoadedModel(spec, config, cfg, model.eval(), ctx, fused)


def random_catalog(level_sizes: tuple[int, ...], size: int, seed: int = 0) -> np.ndarray:
    """`size` unique random SIDs, sorted (int64 [size, depth])."""
    rng = np.random.default_rng(seed)
    space = int(np.prod(level_sizes))
    flat = np.unique(rng.integers(0, space, size=int(size * 1.05) + 16))
    flat = rng.permutation(flat)[:size]
    codes = np.stack(np.unravel_index(np.sort(flat), level_sizes), axis=1).astype(np.int64)
    return codes


@dataclass(frozen=True)
class RequestSpec:
    num_requests: int
    prompt_len: int
    shared_prefix: int
    n: int

    def __post_init__(self) -> None:
        if not 0 <= self.shared_prefix < self.prompt_len:
            raise ValueError(
                f"--shared-prefix {self.shared_prefix} must be at least 0 and below "
                f"--prompt-len {self.prompt_len} (each prompt ends in its own tokens)"
            )


def synthetic_requests(
    spec: RequestSpec, layout: SidLayout, seed: int = 0, body_seed: int | None = None
) -> list[GenerationRequest]:
    """Prompts of random ordinary tokens, the first `shared_prefix` identical in all (drawn from
    `seed`), the rest drawn from `body_seed` (default: seed), ending in <|sid_begin|>."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, layout.sid_start, size=spec.shared_prefix).tolist()
    if body_seed is not None:
        rng = np.random.default_rng(body_seed)
    body = spec.prompt_len - spec.shared_prefix - 1
    out = []
    for _ in range(spec.num_requests):
        tokens = prefix + rng.integers(0, layout.sid_start, size=body).tolist()
        out.append(GenerationRequest(tuple(tokens + [layout.begin_token_id]), spec.n))
    return out
