"""Runs model forwards over the KV pool: the layer between search and the model plugin."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

# re-exported: the step types moved below attention/, engine modules still import them here
from flashrec_core.attention import (  # noqa: F401
    AttentionBackend,
    SharedPrefix,
    StepInput,
    create_attention_backend,
    flatten_shared_prefix,
)
from flashrec_core.attention.segments import SegmentedAttention
from flashrec_core.config import EngineConfig, fresh_prefill_fallback, triton_usable
from flashrec_core.engine.build import LoadedModel, create_kv_pool, load_model
from flashrec_core.kvcache import KVPool, RadixCache, RequestTable, SlotAllocator
from flashrec_core.layers import ForwardBatch
from flashrec_core.registry import Registry
from flashrec_core.spec import ModelConfig

logger = logging.getLogger("flashrec")


DEFAULT_MAX_CONTEXT = 16_384


class ModelRunner:
    """Owns the model, its KV pool, slot allocator, request table and attention backend."""

    def __init__(self, loaded: LoadedModel, sid_depth: int | None = None) -> None:
        """`sid_depth` (the served SIDs' depth) caps the KV pool at what the budgets can use."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.context.device
        self.dtype = loaded.context.dtype
        ecfg = loaded.engine_config
        max_context = ecfg.max_context or min(self.config.max_position, DEFAULT_MAX_CONTEXT)
        self.kv_pool: KVPool = create_kv_pool(loaded, max_context, sid_depth)
        self.allocator = SlotAllocator(self.kv_pool.num_slots)
        self.request_table = RequestTable(ecfg.max_requests, max_context, self.device)
        self.prefix_cache = RadixCache(self.allocator) if ecfg.prefix_cache else None
        cfg = self.config
        self.attn_backend: AttentionBackend = create_attention_backend(
            ecfg.attention_backend, self.device, num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, q_dtype=self.dtype,
            kv_dtype=self.kv_pool.dtype, cascade=ecfg.cascade_attention,
            max_rows=ecfg.max_wave_rows, max_requests=ecfg.max_requests, max_context=max_context,
            layers=cfg.layer_attention(),
        )  # fmt: skip
        beam_attention = ecfg.beam_attention  # resolved: "triton" or "cascade" (the backend's)
        assert beam_attention != "auto", "load_model resolves beam_attention"
        self.beam_attention = beam_attention
        if beam_attention == "triton":
            self.attn_backend = _with_triton_beam_steps(
                self.attn_backend, ecfg, max_context, self.config
            )
        assert ecfg.prefill_attention != "auto", "load_model resolves prefill_attention"
        fresh = ecfg.prefill_attention == "fresh"
        if ecfg.prefill_attention == "triton" or (
            fresh and fresh_prefill_fallback(ecfg, cfg.head_dim) == "triton"
        ):
            self.attn_backend = _with_triton_prefills(
                self.attn_backend, ecfg, max_context, self.config
            )
        if fresh:
            self.attn_backend = _with_fresh_prefills(
                self.attn_backend, ecfg, self.config, self.dtype
            )

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, registry: Registry | None = None, sid_depth: int | None = None
    ) -> ModelRunner:
        return cls(load_model(cfg, registry), sid_depth)

    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head()

    def lm_head_bias(self) -> torch.Tensor | None:
        get_bias = getattr(self.model, "lm_head_bias", None)
        return get_bias() if get_bias is not None else None

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Hidden states [T, H] (final-normed) for every token of the step."""
        dev = self.device
        metadata = self.attn_backend.plan(step)
        return self.forward_batch(
            step.input_ids.to(dev, non_blocking=True),
            step.positions.to(dev, non_blocking=True),
            step.out_cache_loc.to(dev, non_blocking=True),
            metadata,
        )

    @torch.inference_mode()
    def forward_segments(self, steps: list[StepInput]) -> torch.Tensor:
        """Hidden states [T, H] of several steps through one forward, rows in step order: a
        prefill and beam steps read the weights once (attention/segments.py). Each step's
        attention is planned and run as if it were alone."""
        dev = self.device
        segments = SegmentedAttention(self.attn_backend)
        plans = segments.plan(steps)
        return self.forward_batch(
            _cat_on(dev, [s.input_ids for s in steps]),
            _cat_on(dev, [s.positions for s in steps]),
            _cat_on(dev, [s.out_cache_loc for s in steps]),
            plans,
            backend=segments,
        )

    @torch.inference_mode()
    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        attn_metadata: Any,
        backend: Any = None,
    ) -> torch.Tensor:
        """The model on device tensors with an attention plan made beforehand: the capturable
        part of a step (CUDA graphs replay exactly this). `backend` runs the attention instead
        of the runner's (`forward_segments`: a `SegmentedAttention` over it)."""
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend if backend is None else backend,
            attn_metadata=attn_metadata,
        )
        return self.model(batch)

    @property
    def final_logit_softcap(self) -> float | None:
        """The model's final-logit soft-cap (contract v2), for the restricted head."""
        return self.config.final_logit_softcap

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (tests and open-vocabulary baselines; GenRec uses the
        restricted head), soft-capped like the model's own head."""
        out = hidden.float() @ self.lm_head().float().t()
        bias = self.lm_head_bias()
        out = out if bias is None else out + bias.float()
        cap = self.final_logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap


def choose_beam_attention(
    ecfg: EngineConfig, head_dim: int, kv_dtype: torch.dtype | None = None
) -> tuple[str, str]:
    """("triton" | "cascade", why) for an engine config, as `resolve_engine_config` decides it
    (kept for callers that hold an unresolved config; kv_dtype is read from the config)."""
    from flashrec_core.config import _resolve_beam_attention

    ok, why = triton_usable(ecfg)
    probed = ecfg.model_copy(update={"triton_kernels": ok, "triton_reason": why})
    return _resolve_beam_attention(probed, head_dim)


def _with_triton_beam_steps(
    backend: AttentionBackend, ecfg: EngineConfig, max_context: int, config: ModelConfig
) -> AttentionBackend:
    from flashrec_core.attention.triton_beam import TritonBeamAttention

    device = torch.device(ecfg.device)
    return TritonBeamAttention(
        backend, device, max_rows=ecfg.max_wave_rows,
        max_prompt_slots=ecfg.max_requests * max_context, layers=config.layer_attention(),
        head_dim=config.head_dim, fp8_scores=ecfg.fp8_attention_scores,
    )  # fmt: skip


def _with_triton_prefills(
    backend: AttentionBackend, ecfg: EngineConfig, max_context: int, config: ModelConfig
) -> AttentionBackend:
    from flashrec_core.attention.triton_prefill import TritonPrefillAttention
    from flashrec_core.engine.prefill_graph import SEQUENCE_BUCKETS

    return TritonPrefillAttention(
        backend, torch.device(ecfg.device), num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, max_context=max_context,
        max_graph=(ecfg.prefill_graph_tokens, SEQUENCE_BUCKETS[-1]),
        layers=config.layer_attention(),
    )  # fmt: skip


def _with_fresh_prefills(
    backend: AttentionBackend, ecfg: EngineConfig, config: ModelConfig, dtype: torch.dtype
) -> AttentionBackend:
    from flashrec_core.attention.fresh_prefill import FreshPrefillAttention
    from flashrec_core.engine.prefill_graph import SEQUENCE_BUCKETS

    return FreshPrefillAttention(
        backend, torch.device(ecfg.device), num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        dtype=dtype, max_graph=(ecfg.prefill_graph_tokens, SEQUENCE_BUCKETS[-1]),
        layers=config.layer_attention(), triton_copies=bool(ecfg.triton_kernels),
    )  # fmt: skip


def prepare_prefill(
    prompts: list[list[int]],
    slots: list[torch.Tensor],
    prefix_lens: list[int] | None = None,
    ends: list[int] | None = None,
) -> StepInput:
    """A prefill step: each prompt's tokens after its cached prefix (up to `ends[i]`, default
    the whole prompt: a chunked prefill computes a prompt in pieces), attending to all its slots
    before that end. Built in numpy and wrapped once: on the engine thread, before the prefill
    is launched, `torch.tensor` of a 960-token list took 110 us and each small `torch.cat` 9 us,
    numpy 32 and 1 us."""
    prefix_lens = prefix_lens or [0] * len(prompts)
    ends = ends or [len(t) for t in prompts]
    host = [s.numpy() for s in slots]
    starts = np.asarray(prefix_lens, dtype=np.int64)
    stops = np.asarray(ends, dtype=np.int64)
    qo = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(stops - starts, out=qo[1:])
    kv = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(stops, out=kv[1:])
    pairs = list(zip(prompts, host, prefix_lens, ends))
    return StepInput(
        input_ids=_tensor(
            np.concatenate([np.array(t[p:n], dtype=np.int64) for t, _, p, n in pairs])
        ),
        positions=_tensor(
            np.concatenate([np.arange(p, n, dtype=np.int64) for p, n in zip(prefix_lens, ends)])
        ),
        out_cache_loc=_tensor(np.concatenate([s[p:n] for _, s, p, n in pairs])),
        qo_indptr=torch.from_numpy(qo),
        kv_indptr=torch.from_numpy(kv),
        kv_indices=_tensor(np.concatenate([s[:n] for s, n in zip(host, ends)])),
    )


def _tensor(a: np.ndarray) -> torch.Tensor:
    """int64 host tensor over a numpy array (no copy when it is int64 already)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _cat_on(device: torch.device, parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated on `device`: a prefill's inputs are built on the host, a beam step's tokens
    and slots on the device (no sync), and torch.cat takes one device."""
    return torch.cat([p.to(device, non_blocking=True) for p in parts])
