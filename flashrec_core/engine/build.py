"""Building a model from a checkpoint: resolve the spec, fused paths, build, load, size the pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashrec_core.config import (
    DTYPES,
    KV_DTYPES,
    EngineConfig,
    resolve_engine_config,
    triton_usable,
)
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import BuildContext
from flashrec_core.loader import load_weights
from flashrec_core.registry import Registry, read_model_config
from flashrec_core.spec import FusedPath, ModelConfig, ModelSpec

logger = logging.getLogger("flashrec")

CPU_KV_TOKENS = 65_536


@dataclass(frozen=True)
class FusedDecision:
    path: str
    enabled: bool
    reason: str


def resolve_fused_paths(
    spec: ModelSpec, cfg: EngineConfig, fp8_linear: bool, kv_dtype: torch.dtype
) -> tuple[dict[str, Callable[..., Any]], list[FusedDecision]]:
    """Decide once, per path: user switch AND spec capability AND kernel available AND static
    preconditions. Returns the enabled kernels and every decision (for logs and `flashrec models`)."""
    check_switch_names(spec, cfg)
    triton_ok, triton_why = triton_usable(cfg)
    kernels: dict[str, Callable[..., Any]] = {}
    decisions = []
    for path in spec.capabilities:
        reason = _blocker(path, cfg, fp8_linear, kv_dtype, triton_ok, triton_why)
        if reason is None:
            try:
                kernels[path.name] = path.load_kernel()
            except (ImportError, AttributeError) as exc:
                reason = f"kernel {path.kernel} failed to import: {exc}"
        decisions.append(FusedDecision(path.name, reason is None, reason or "on"))
        logger.info("fused path %-16s %s", path.name, "on" if reason is None else f"off ({reason})")
    return kernels, decisions


def check_switch_names(spec: ModelSpec, cfg: EngineConfig) -> None:
    """Every switch turned off by name (--disable-fused) exists: the engine's own or one of the
    spec's paths; a typo is an error listing the valid names, never silently ignored."""
    valid = {name for name in EngineConfig.model_fields if name.startswith("enable_fused_")}
    valid |= {c.switch for c in spec.capabilities}
    unknown = [name for name in cfg.disabled_fused if name not in valid]
    if unknown:
        raise ValueError(
            f"--disable-fused {', '.join(unknown)}: no such switch for {spec.name}; valid: "
            f"{', '.join(sorted(valid))}"
        )


def _blocker(
    path: FusedPath,
    cfg: EngineConfig,
    fp8_linear: bool,
    kv_dtype: torch.dtype,
    triton_ok: bool,
    triton_why: str,
) -> str | None:
    if not cfg.switch(path.switch):
        return f"{path.switch}=False"
    if "triton" in path.requires and not triton_ok:
        return triton_why
    if "fp8_linear" in path.requires and not fp8_linear:
        return "FP8 linears are off"
    if "fp8_kv" in path.requires and kv_dtype != torch.float8_e4m3fn:
        return "the KV pool is not FP8"
    return None


@dataclass
class LoadedModel:
    """A built, loaded model with everything that was decided on the way."""

    spec: ModelSpec
    config: ModelConfig
    engine_config: EngineConfig
    model: nn.Module
    context: BuildContext
    fused: list[FusedDecision]


def load_model(cfg: EngineConfig, registry: Registry | None = None) -> LoadedModel:
    """Resolve the architecture's plugin, parse config.json, build the model and load weights."""
    spec, model_config = read_model_config(cfg.model_path, cfg.arch, registry)
    arch = model_config.architecture
    cfg = resolve_engine_config(
        cfg, model_config.quantization is not None, head_dim=model_config.head_dim
    )
    ctx, fused = create_build_context(spec, cfg)
    with torch.device(ctx.device):
        model = spec.load_model_class()(model_config, ctx)
    model.eval()
    report = load_weights(
        model, spec, model_config, cfg.model_path, show_progress=cfg.show_progress
    )
    logger.info(
        "loaded %s (%d tensors, %.1f MB) in %.2f s",
        arch, report.num_tensors, report.bytes_read / 1e6, report.seconds,
    )  # fmt: skip
    return LoadedModel(spec, model_config, cfg, model, ctx, fused)


def create_build_context(
    spec: ModelSpec, cfg: EngineConfig
) -> tuple[BuildContext, list[FusedDecision]]:
    """The BuildContext for a resolved EngineConfig (no "auto" values left)."""
    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    kv_dtype = KV_DTYPES[cfg.kv_cache_dtype]
    fp8 = cfg.quantization == "fp8"
    kernels, decisions = resolve_fused_paths(spec, cfg, fp8, kv_dtype)
    triton_ok, _ = triton_usable(cfg)
    small_rows = cfg.fp8_gemm_triton_rows if triton_ok and fp8 else 0
    ctx = BuildContext(
        device=device, dtype=dtype, fp8_linear=fp8, kv_dtype=kv_dtype, fused=kernels,
        triton=triton_ok, small_gemm_rows=small_rows,
    )  # fmt: skip
    if small_rows is None:
        logger.info("small-row FP8 GEMM: per projection, as far as the GPU's launch table says")
    else:
        logger.info("small-row FP8 GEMM: %s", f"up to {small_rows} rows" if small_rows else "off")
    return ctx, decisions


def workload_kv_tokens(cfg: EngineConfig, max_context: int, sid_depth: int) -> int:
    """The most KV slots the engine's budgets can have in use at once: every request slot
    holding a prompt of `max_context` tokens, plus the beams of the waves in flight (a wave
    takes `sid_depth - 1` steps after its prefill and one is admitted per iteration, after the
    finishing wave handed its KV back, so `sid_depth - 1` waves hold beams at once; each of a
    wave's at most `max_wave_rows` beams holds one slot per step), plus the reserved slot 0.
    A pool larger than this holds only cached prefixes of finished requests."""
    steps = max(sid_depth - 1, 0)
    beams = steps * cfg.max_wave_rows * steps
    return cfg.max_requests * max_context + beams + 1


def kv_pool_tokens(
    cfg: EngineConfig, per_token: int, free_bytes: int | None, max_context: int,
    sid_depth: int | None,
) -> tuple[int, str]:  # fmt: skip
    """Token slots of the KV pool and why: `--kv-cache-tokens`; else, given the device's free
    memory after the weights (`free_bytes`, None on CPU), `mem_fraction` of it, capped at what
    the budgets can use when the SID depth is known; else the CPU default."""
    if cfg.kv_cache_tokens is not None:
        return cfg.kv_cache_tokens, "--kv-cache-tokens"
    if free_bytes is None:
        return CPU_KV_TOKENS, "the CPU default"
    share = int(free_bytes * cfg.mem_fraction) // per_token
    need = workload_kv_tokens(cfg, max_context, sid_depth) if sid_depth is not None else share
    if need < share:
        return need, (
            f"what the budgets can use: {cfg.max_requests} requests x {max_context} tokens "
            f"(--max-requests, --max-context) + the beams of {sid_depth - 1} waves in flight"
        )
    return share, f"--mem-fraction {cfg.mem_fraction} of the free memory"


def create_kv_pool(loaded: LoadedModel, max_context: int, sid_depth: int | None = None) -> KVPool:
    """The KV pool, sized by `kv_pool_tokens`."""
    cfg, mc, ctx = loaded.engine_config, loaded.config, loaded.context
    assert ctx.kv_dtype is not None, "the build context carries the resolved KV dtype"
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, ctx.kv_dtype)
    free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else None
    tokens, why = kv_pool_tokens(cfg, per_token, free, max_context, sid_depth)
    if tokens < 2:
        raise RuntimeError(
            f"KV pool would hold {tokens} tokens ({per_token} bytes each); free GPU memory "
            "or lower the model size; --kv-cache-tokens sets the pool explicitly"
        )
    logger.info(
        "KV pool: %d token slots x %d bytes = %.2f GiB (%s; %s)",
        tokens, per_token, tokens * per_token / 2**30, ctx.kv_dtype, why,
    )  # fmt: skip
    return KVPool(mc.num_layers, mc.num_kv_heads, mc.head_dim, tokens, ctx.kv_dtype, ctx.device)
