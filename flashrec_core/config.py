"""Engine settings: validated once (pydantic, frozen), "auto" values resolved once into a copy."""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("flashrec")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}


Schedule = Literal["interleaved", "decode_first", "admit_first"]


class EngineConfig(BaseModel):
    """How to load and run a model. Every CLI flag and server setting ends up here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    arch: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "fp8", "none"] = "auto"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"] = "auto"
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    kv_cache_tokens: int | None = Field(default=None, gt=1)
    """Token slots in the KV pool; None sizes it from free memory (CUDA) or 65,536 (CPU)."""
    mem_fraction: float = Field(default=0.7, gt=0.0, le=1.0)
    """The KV pool's share of the GPU memory free after the weights load (when kv_cache_tokens is
    None and the budgets can use more). The rest holds activations, CUDA graph pools and
    workspaces: on an H100 80GB the server's warm-up at n=50 (84 graph captures, waves up to 8,150
    beam rows) needed more than the 11.6 GiB that 0.85 left and ran out of memory; at 0.7 (23 GiB
    left) it is ready and serves (docs/benchmarks.md, session 21)."""
    prefix_cache: bool = True
    """Reuse the KV of prompt prefixes seen before (radix tree, LRU eviction)."""
    cascade_attention: bool = True
    """Beam decode steps read each request's prompt KV once for all its beams (FlashInfer)."""
    beam_attention: Literal["auto", "cascade", "triton"] = "auto"
    """Beam steps' attention: "triton" = one Triton kernel per layer over each request's prompt and
    each beam's own slots (`flashrec_kernels.beam_cascade_attention`); "cascade" = the backend's
    two levels (FlashInfer prefix prefill + per-beam decode + merge, or the torch reference; flat
    per-beam decode with cascade_attention=False). "auto" picks "triton" on CUDA with
    cascade_attention, a bf16 model, a bf16/FP8 KV cache and a power-of-two head_dim <= 256."""
    prefill_attention: Literal["auto", "backend", "triton", "fresh"] = "auto"
    """Prompt prefills' attention: "triton" = `flashrec_kernels.prefill_attention` (causal, over
    the paged pool, GQA packed into its query tiles); "backend" = the attention backend's own
    prefill (FlashInfer's, or the torch reference). "auto" picks "triton" where the beam kernel
    applies (the same conditions: CUDA, a bf16 model, a bf16/FP8 KV cache, a power-of-two
    head_dim <= 256), and "fresh" where also FlashInfer runs on sm90 with a head dim of 64, 128
    or 256. "fresh": over the prompt's own new keys and values in the model's dtype, and its
    cached context copied from the pool, through FlashInfer's ragged prefill (FA3 on sm90; the
    torch reference off CUDA); prefills with more context than new tokens take the Triton
    kernel's path, or the backend's where it does not apply (attention/fresh_prefill.py)."""
    cuda_graphs: bool = True
    """Replay each beam decode step (forward, restricted head, trie mask, top-k, expansion) as one
    CUDA graph; needs CUDA and a beam-step attention path that captures (FlashInfer, or the Triton
    beam kernel over any backend), else steps run eagerly (logged)."""
    prefill_graph_tokens: int = Field(default=8192, ge=0)
    """Prefills of up to this many new tokens (from up to 16 requests) replay a CUDA graph of the
    model forward (engine/prefill_graph.py); larger ones, GPU-bound, run eagerly. 0: never."""
    prefill_chunk_tokens: int | None = Field(default=None, ge=0)
    """A prefill of more new tokens runs as several forwards of at most this many (a prompt may
    span two), so its activations stay bounded whatever the wave's size. None: the largest
    prefill graph less room for its pad sequences (8184; a chunk of up to 16 requests then
    replays that graph), or 32,768 without prefill graphs. 0: one forward per wave."""
    max_requests: int = Field(default=1024, gt=0)
    schedule: Schedule = "interleaved"
    """When the engine loop admits a new wave. "interleaved": at every step boundary, so a new
    wave's prefill runs between the steps of the waves in flight; "decode_first": once the
    waves in flight have run their last step; "admit_first": at every step boundary, before the
    waves in flight step, so a new wave takes its first beam step in the forward they share
    (one iteration less a request for the same GPU work, but on an H100 no shorter latency:
    its iterations ran longer; docs/benchmarks.md, session 30; engine/loop.py)."""
    prefill_tokens_per_step: int | None = Field(default=None, gt=0)
    """Chunked prefill: while waves are in flight, a new wave's prefill runs about this many new
    prompt tokens per loop iteration (whole forwards of at most `prefill_chunk_tokens`, at least
    one), so the waves in flight step between its pieces and a beam step waits for one piece of
    prefill, not a whole wave's (engine/loop.py). None: a wave's whole prefill at once. Meant to
    lower the latency tail under load; on an H100 at 0.7x of saturation it did not
    (docs/benchmarks.md, session 28)."""
    merge_beam_steps: bool | None = None
    """The beam steps of the waves in flight run as one model forward per loop iteration (rows
    of every wave, at whatever level, then each wave's own selection): under load the weights
    are read once per iteration instead of once per wave (engine/beam_wave.py
    `advance_together`). With CUDA graphs, small greedy waves step through one
    captured graph of the merged step; other waves step alone. None (the default): on where
    those graphs run (CUDA graphs with the Triton beam kernel, the CUDA default), off
    elsewhere. Measured on an H100 under open load (session 25): iterations 11.1 -> 9.5 ms and
    p50 51 -> 44 ms at 0.7x."""
    mixed_prefill_steps: bool = True
    """An admitted wave's prefill carries the beam steps of waves in flight (one step group of
    `step_groups`) in the same model forward, each step's attention planned as if alone
    (`ModelRunner.forward_segments`): the weights are read once per iteration, not once for
    the prefill and again for the steps (docs/architecture.md, "The latency tail under load").
    Applies to a prefill of one forward without chunked prefill (`prefill_tokens_per_step`):
    eagerly where both run eagerly (e.g. on CPU), and with CUDA graphs only when
    `mixed_prefill_tokens` is set (engine/cuda_graph.py `run_mixed`)."""
    mixed_prefill_tokens: int = Field(default=0, ge=0)
    """With CUDA graphs, the most new prompt tokens of a prefill that carries beam steps
    (`mixed_prefill_steps`: a prefill of one or two requests beside waves that step in a
    merged graph); mixed graphs are captured per prefill bucket (512, 1024, 2048, ... up to
    this) and step shape. 0 (the default): mixing only where forwards run eagerly. Off by
    default because on an H100 with 1,024-token prompts it lengthened the 0.7x tail (p50 63
    against 48 ms, p99 245 against 133; docs/benchmarks.md, session 29): a 1,024-token
    prefill is compute-bound, so the steps' rows cost as much inside it as apart."""
    fp8_attention_scores: bool = False
    """Experimental, off: the Triton beam kernel's prompt score dot on FP8 tensor cores, each
    query row rounded in the kernel to e4m3 under its own scale and the FP8 keys taken as
    loaded (twice the dot rate, no key conversion; queries keep 4 significant bits instead of
    8). On an H100 the kernel ran 11-12% faster at 1,024-token prompts; its beam scores are
    not yet measured (docs/benchmarks.md, session 37). The prefill kernel's FP8 dot gained
    nothing there, so prefills keep bf16 queries. Needs an FP8 KV cache and the beam kernel."""
    fp8_gemm_triton_rows: int | None = Field(default=None, ge=0)
    """FP8 projections of at most this many rows (the beam steps of small waves) run through the
    Triton small-row GEMM (`flashrec_kernels.fp8_gemm`) instead of `torch._scaled_mm`, whose
    row-wise-scaled kernels read the weights at ~20% of an H100's bandwidth at 50 rows
    (scripts/bench_gemm.py). 0: never. None: per projection, the row count up to which the
    GPU's launch table measured the kernel faster (`fp8_gemm_rows`; 0 without a table for this
    GPU and shape: cuBLAS. Tables: the H100 80GB's, session 23). Needs Triton kernels and FP8
    weights, else 0."""
    host_threads: int | None = Field(default=None, ge=1)
    """torch intra-op (CPU) threads of the thread that runs the engine loop (the server's engine
    thread, or the caller of `Engine.generate` while it runs). None: 1 on CUDA, where that
    thread's CPU ops are small host work and more OpenMP workers only spin-wait between them
    (H100, session 22: 6.6 -> 1.2 ms of server CPU per request outside the engine thread, and
    +5% throughput; docs/benchmarks.md); on CPU, where the model runs on those threads, torch's
    default (all cores)."""
    max_wave_rows: int = Field(default=8192, gt=0)
    """Beam rows (sum of n) that share one decode step; `generate` packs requests into waves."""
    max_context: int | None = Field(default=None, gt=0)
    """Longest prompt in tokens; default: the model's max_position_embeddings, capped at 16,384."""
    enable_fused_rms_fp8: bool = True
    enable_fused_silu_fp8: bool = True
    enable_fused_qk_rope_kv: bool = True
    enable_fused_trie_topk: bool = True
    """Beam selection through the Triton trie-mask + top-k kernel on CUDA (else torch ops)."""
    disabled_fused: tuple[str, ...] = ()
    """Further fused-path switches turned off by name (plugin paths such as enable_fused_gelu_fp8)."""
    triton_on_cpu: bool = False
    """Run Triton kernels on CPU through the interpreter (TRITON_INTERPRET=1); a testing aid."""
    triton_kernels: bool | None = None
    """Resolved, not set by users: whether Triton kernels run here (None before resolution;
    `resolve_engine_config` probes once and every reader takes it from here)."""
    triton_reason: str = ""
    """Resolved with `triton_kernels`: why they cannot run, when they cannot."""
    show_progress: bool = True

    def switch(self, name: str) -> bool:
        """Value of an `enable_fused_*` switch; unknown plugin switches default to on."""
        if name in self.disabled_fused:
            return False
        return bool(getattr(self, name, True))


def resolve_engine_config(
    cfg: EngineConfig, checkpoint_quantized: bool, head_dim: int | None = None
) -> EngineConfig:
    """Replace every "auto" by a concrete choice for this machine and checkpoint, and log it: the
    one place they are decided (device, dtypes, quantization, attention backend, beam-step
    attention when `head_dim` is known, Triton availability, CUDA graphs)."""
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise RuntimeError("--device cuda was requested but torch sees no CUDA device")
    device = cfg.device if cfg.device != "auto" else ("cuda" if cuda else "cpu")
    on_gpu = device == "cuda"
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    quant = cfg.quantization
    if quant == "auto":
        quant = "fp8" if (checkpoint_quantized or on_gpu) else "none"
    kv = cfg.kv_cache_dtype
    if kv == "auto":
        kv = "fp8_e4m3" if (on_gpu and quant == "fp8") else dtype
    backend = _resolve_attention_backend(cfg.attention_backend, device)
    resolved = cfg.model_copy(
        update={
            "device": device, "dtype": dtype, "quantization": quant, "kv_cache_dtype": kv,
            "attention_backend": backend, "cuda_graphs": cfg.cuda_graphs and on_gpu,
        }
    )  # fmt: skip
    ok, why = _probe_triton(resolved)
    resolved = resolved.model_copy(update={"triton_kernels": ok, "triton_reason": why})
    if head_dim is not None:
        beam, beam_why = _resolve_beam_attention(resolved, head_dim)
        logger.info("beam steps attend through %s (%s)", beam, beam_why)
        prefill, prefill_why = _resolve_prefill_attention(resolved, head_dim)
        logger.info("prefills attend through %s (%s)", prefill, prefill_why)
        resolved = resolved.model_copy(
            update={"beam_attention": beam, "prefill_attention": prefill}
        )
        _check_fp8_attention_scores(resolved)
    logger.info(
        "engine: device=%s dtype=%s quantization=%s kv_cache_dtype=%s attention_backend=%s "
        "triton=%s%s cuda_graphs=%s",
        device, dtype, quant, kv, backend, ok, f" ({why})" if why else "", resolved.cuda_graphs,
    )  # fmt: skip
    return resolved


def _check_fp8_attention_scores(cfg: EngineConfig) -> None:
    """`fp8_attention_scores` rounds queries in the Triton beam kernel against FP8 keys:
    refused, with what to change, where that kernel does not run or the cache is not FP8."""
    if not cfg.fp8_attention_scores:
        return
    if cfg.kv_cache_dtype != "fp8_e4m3":
        raise ValueError(
            f"--fp8-attention-scores needs an FP8 KV cache, but kv_cache_dtype is "
            f"{cfg.kv_cache_dtype}; pass --kv-cache-dtype fp8_e4m3 or drop the flag"
        )
    if cfg.beam_attention != "triton":
        raise ValueError(
            "--fp8-attention-scores applies to the Triton beam kernel, which does not run here "
            f"(beam attention {cfg.beam_attention}); pass --beam-attention triton or drop the flag"
        )


def _resolve_prefill_attention(cfg: EngineConfig, head_dim: int) -> tuple[str, str]:
    """("fresh" | "triton" | "backend", why). "auto" takes the Triton prefill kernel wherever the
    beam kernel's conditions hold (both take bf16 queries over the pool and the same head dims):
    on an H100 it halved a 1,024-token prompt's attention (docs/benchmarks.md, session 20). On
    sm90 with FlashInfer it takes the fresh prefill over it (FA3 over the prompt's own K/V, the
    Triton kernel for the steps fresh leaves): on H100s `Engine.generate` gained 1.3-2.6% at
    n=50, 1.5% at n=512 and 1.1% at n=1024 (sessions 38-39), and the whole GPU tier passed with
    it as the default."""
    if cfg.prefill_attention == "triton" and not cfg.triton_kernels:
        raise ValueError(
            f"--prefill-attention triton needs Triton kernels here: {cfg.triton_reason}"
        )
    if cfg.prefill_attention == "fresh" and cfg.device == "cuda" and not flashinfer_available():
        raise ValueError(
            "--prefill-attention fresh runs FlashInfer's ragged prefill on CUDA, and flashinfer "
            "is not installed: pip install 'flashrec-core[gpu]', or use --prefill-attention auto"
        )
    if cfg.prefill_attention != "auto":
        return cfg.prefill_attention, "asked for"
    why_not = _attention_kernel_unfit(cfg, head_dim)
    if why_not:
        return "backend", f"auto: {why_not}"
    if _fresh_prefill_measured(cfg, head_dim):
        return "fresh", "auto: FlashInfer's FA3 over the prompts' own K/V on sm90"
    return "triton", "auto"


def _fresh_prefill_measured(cfg: EngineConfig, head_dim: int) -> bool:
    """Where the fresh prefill was measured faster: FlashInfer's FA3 ragged kernel (sm90), for a
    head dim it is built for. Elsewhere (FA2 on sm80, no FA3 on sm100) it is unmeasured."""
    if cfg.attention_backend != "flashinfer" or cuda_capability() != 9:
        return False
    from flashrec_core.attention.fresh_prefill import HEAD_DIMS

    return head_dim in HEAD_DIMS


def cuda_capability() -> int:
    """The CUDA device's compute capability major (9 on Hopper), 0 without one."""
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


def fresh_prefill_fallback(cfg: EngineConfig, head_dim: int) -> str:
    """Where "fresh" prefills send the steps it leaves (long context, one query per sequence):
    "triton" where the Triton prefill kernel applies, else "backend"."""
    return "backend" if _attention_kernel_unfit(cfg, head_dim) else "triton"


def _resolve_beam_attention(cfg: EngineConfig, head_dim: int) -> tuple[str, str]:
    """("triton" | "cascade", why). "auto" takes the one-pass Triton kernel wherever it
    applies: on an H200 it made the 1.7B-parameter benchmark decode step 2.6x faster than
    FlashInfer's cascade (docs/benchmarks.md)."""
    if cfg.beam_attention == "triton" and not cfg.triton_kernels:
        raise ValueError(f"--beam-attention triton needs Triton kernels here: {cfg.triton_reason}")
    if cfg.beam_attention != "auto":
        return cfg.beam_attention, "asked for"
    if cfg.device == "cuda" and not cfg.cascade_attention:
        return "cascade", "auto: cascade_attention=False asks for flat per-beam decode"
    why_not = _attention_kernel_unfit(cfg, head_dim)
    return ("cascade", f"auto: {why_not}") if why_not else ("triton", "auto")


def _attention_kernel_unfit(cfg: EngineConfig, head_dim: int) -> str | None:
    """Why the Triton attention kernels (beam and prefill) would not run here, or None: they
    take bf16 queries over a bf16 or FP8 pool on CUDA, with a power-of-two head_dim <= 256."""
    if cfg.device != "cuda":
        return f"device is {cfg.device}"
    if cfg.dtype != "bfloat16" or cfg.kv_cache_dtype not in ("bfloat16", "fp8_e4m3"):
        return f"the kernel takes bf16 queries and a bf16/FP8 cache, not {cfg.kv_cache_dtype}"
    if head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two <= 256"
    return None if cfg.triton_kernels else cfg.triton_reason


def _resolve_attention_backend(name: str, device: str) -> str:
    """ "auto" -> flashinfer on CUDA when it imports, else torch; an explicit flashinfer that
    cannot run here is an error that says what to use instead."""
    if name == "auto":
        return "flashinfer" if device == "cuda" and flashinfer_available() else "torch"
    if name == "flashinfer" and device != "cuda":
        raise ValueError(
            f"--attention-backend flashinfer needs a CUDA device, but this engine runs on "
            f"{device}; use --attention-backend torch (or auto)"
        )
    if name == "flashinfer" and not flashinfer_available():
        raise ValueError(
            "--attention-backend flashinfer: the flashinfer package is not installed; "
            "pip install 'flashrec-core[gpu]', or use --attention-backend torch (or auto)"
        )
    return name


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def triton_usable(cfg: EngineConfig) -> tuple[bool, str]:
    """Whether Triton kernels can run for this config, and why not when they cannot: the value
    `resolve_engine_config` decided, once."""
    if cfg.triton_kernels is not None:
        return cfg.triton_kernels, cfg.triton_reason
    return _probe_triton(cfg)


def _probe_triton(cfg: EngineConfig) -> tuple[bool, str]:
    if cfg.device == "cpu":
        if not cfg.triton_on_cpu:
            return False, "no Triton backend on CPU"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False, "triton_on_cpu needs TRITON_INTERPRET=1 set before triton is imported"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""


class SearchConfig(BaseModel):
    """How beam search scores and constrains SIDs (shared by every request of an engine)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    catalog_path: str | None = None
    sid_normalization: Literal["level", "sid"] = "level"
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    """score = logprob / depth ** length_penalty; NaN or inf would rank nothing (and print NaN)."""
    trie_kind: Literal["auto", "dense", "csr"] = "auto"
    sid_level_sizes: tuple[int, ...] | None = None
    """Explicit codebook sizes; must agree with the tokenizer's SID tokens."""
    sid_depth: int | None = None
    """Use the first `sid_depth` codebook levels; defaults to the catalog's depth."""
    append_sid_begin: bool = True
    """Append <|sid_begin|> to the prompt when the tokenizer has it."""


def describe_settings_error(exc: ValidationError) -> str:
    """One line naming each bad setting (the CLI flag `--name-with-dashes`) and its value."""
    parts = []
    for err in exc.errors():
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        parts.append(f"{flag} {err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
