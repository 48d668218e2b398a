"""Runs model forwards over the KV pool: the layer between search and the model plugin."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from flashrec_core.attention import AttentionBackend, create_attention_backend
from flashrec_core.config import EngineConfig, triton_usable
from flashrec_core.engine.build import LoadedModel, create_kv_pool, load_model
from flashrec_core.kvcache import KVPool, RadixCache, RequestTable, SlotAllocator
from flashrec_core.layers import ForwardBatch
from flashrec_core.registry import Registry

logger = logging.getLogger("flashrec")


@dataclass(frozen=True)
class SharedPrefix:
    """Two-level view of a beam decode step, for cascade attention.

    Level 0: rows of request b (prefix_qo_indptr[b]:prefix_qo_indptr[b+1]) share the prompt
    slots prefix_kv_indices[prefix_kv_indptr[b]:prefix_kv_indptr[b+1]]. Level 1: row r's own
    slots suffix_kv_indices[suffix_kv_indptr[r]:suffix_kv_indptr[r+1]] (ancestors + its own).
    """

    prefix_qo_indptr: torch.Tensor
    prefix_kv_indptr: torch.Tensor
    prefix_kv_indices: torch.Tensor
    suffix_kv_indptr: torch.Tensor
    suffix_kv_indices: torch.Tensor


def flatten_shared_prefix(sp: SharedPrefix) -> torch.Tensor:
    """Flat per-row slot lists (row r: its request's prefix slots, then its suffix slots),
    concatenated, on the device of the suffix indices. Vectorized: no host loop over rows."""
    device = sp.suffix_kv_indices.device
    rows_per_req = sp.prefix_qo_indptr[1:] - sp.prefix_qo_indptr[:-1]
    req = torch.repeat_interleave(torch.arange(rows_per_req.numel()), rows_per_req).to(device)
    prefix_ptr, suffix_ptr = sp.prefix_kv_indptr.to(device), sp.suffix_kv_indptr.to(device)
    prefix_len = (prefix_ptr[1:] - prefix_ptr[:-1])[req]
    kv_len = prefix_len + (suffix_ptr[1:] - suffix_ptr[:-1])
    rows = torch.repeat_interleave(torch.arange(req.numel(), device=device), kv_len)
    starts = torch.cumsum(kv_len, 0) - kv_len
    pos = torch.arange(rows.numel(), device=device) - starts[rows]  # position within the row
    in_prefix = pos < prefix_len[rows]
    prefix = sp.prefix_kv_indices.to(device)
    from_prefix = prefix[(prefix_ptr[req][rows] + pos).clamp(max=max(prefix.numel() - 1, 0))]
    from_suffix = sp.suffix_kv_indices[
        (suffix_ptr[rows] + pos - prefix_len[rows]).clamp(
            min=0, max=sp.suffix_kv_indices.numel() - 1
        )
    ]
    return torch.where(in_prefix, from_prefix, from_suffix)


@dataclass(frozen=True)
class StepInput:
    """Host-side description of one forward step over several sequences (built in prepare_*).

    Sequence b contributes tokens input_ids[qo_indptr[b]:qo_indptr[b+1]] and attends to the slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (its own new slots last).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor | None  # [sum kv]; None when only shared_prefix is given
    shared_prefix: SharedPrefix | None = None

    def flat_kv_indices(self) -> torch.Tensor:
        """Per-row slot lists, derived from the two-level view when only that was built."""
        if self.kv_indices is not None:
            return self.kv_indices
        assert self.shared_prefix is not None, "a step has flat indices or a shared prefix"
        return flatten_shared_prefix(self.shared_prefix)


DEFAULT_MAX_CONTEXT = 16_384


class ModelRunner:
    """Owns the model, its KV pool, slot allocator, request table and attention backend."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.context.device
        self.dtype = loaded.context.dtype
        self.kv_pool: KVPool = create_kv_pool(loaded)
        self.allocator = SlotAllocator(self.kv_pool.num_slots)
        ecfg = loaded.engine_config
        max_context = ecfg.max_context or min(self.config.max_position, DEFAULT_MAX_CONTEXT)
        self.request_table = RequestTable(ecfg.max_requests, max_context, self.device)
        self.prefix_cache = RadixCache(self.allocator) if ecfg.prefix_cache else None
        cfg = self.config
        self.attn_backend: AttentionBackend = create_attention_backend(
            ecfg.attention_backend, self.device, num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, q_dtype=self.dtype,
            kv_dtype=self.kv_pool.dtype, cascade=ecfg.cascade_attention,
            max_rows=ecfg.max_wave_rows, max_requests=ecfg.max_requests, max_context=max_context,
        )  # fmt: skip
        beam_attention, why = choose_beam_attention(ecfg, cfg.head_dim, self.kv_pool.dtype)
        logger.info("beam steps attend through %s (%s)", beam_attention, why)
        self.beam_attention = beam_attention  # "triton" or "cascade" (the backend's own)
        if beam_attention == "triton":
            self.attn_backend = _with_triton_beam_steps(self.attn_backend, ecfg, max_context)

    @classmethod
    def from_config(cls, cfg: EngineConfig, registry: Registry | None = None) -> ModelRunner:
        return cls(load_model(cfg, registry))

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
    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """The model on device tensors with an attention plan made beforehand: the capturable
        part of a step (CUDA graphs replay exactly this)."""
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            attn_metadata=attn_metadata,
        )
        return self.model(batch)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (tests and open-vocabulary baselines; GenRec uses the
        restricted head)."""
        out = hidden.float() @ self.lm_head().float().t()
        bias = self.lm_head_bias()
        return out if bias is None else out + bias.float()


def choose_beam_attention(
    ecfg: EngineConfig, head_dim: int, kv_dtype: torch.dtype
) -> tuple[str, str]:
    """("triton" | "cascade", why) for a resolved engine config. "auto" takes the one-pass Triton
    kernel wherever it applies: on an H200 it made the 1.7B-parameter benchmark decode step 2.6x faster
    than FlashInfer's cascade (docs/benchmarks.md)."""
    if ecfg.beam_attention != "auto":
        return ecfg.beam_attention, "asked for"
    if ecfg.device != "cuda":
        return "cascade", f"auto: device is {ecfg.device}"
    if not ecfg.cascade_attention:
        return "cascade", "auto: cascade_attention=False asks for flat per-beam decode"
    if ecfg.dtype != "bfloat16" or kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return (
            "cascade",
            f"auto: the kernel takes bf16 queries and a bf16/FP8 cache, not {kv_dtype}",
        )
    if head_dim > 256 or head_dim & (head_dim - 1):
        return "cascade", f"auto: head_dim {head_dim} is not a power of two <= 256"
    ok, why = triton_usable(ecfg)
    return ("triton", "auto") if ok else ("cascade", f"auto: {why}")


def _with_triton_beam_steps(
    backend: AttentionBackend, ecfg: EngineConfig, max_context: int
) -> AttentionBackend:
    from flashrec_core.attention.triton_beam import TritonBeamAttention

    ok, why = triton_usable(ecfg)
    if not ok:
        raise ValueError(f"beam_attention='triton' needs Triton kernels here: {why}")
    device = torch.device(ecfg.device)
    return TritonBeamAttention(
        backend, device, max_rows=ecfg.max_wave_rows,
        max_prompt_slots=ecfg.max_requests * max_context,
    )  # fmt: skip


def prepare_prefill(
    prompts: list[list[int]], slots: list[torch.Tensor], prefix_lens: list[int] | None = None
) -> StepInput:
    """A prefill step: each prompt's tokens after its cached prefix, attending to all its slots."""
    prefix_lens = prefix_lens or [0] * len(prompts)
    ids, pos, loc, qo, kv = [], [], [], [0], [0]
    for tokens, s, p in zip(prompts, slots, prefix_lens):
        n = len(tokens)
        ids.append(torch.tensor(tokens[p:], dtype=torch.int64))
        pos.append(torch.arange(p, n, dtype=torch.int64))
        loc.append(s[p:n])
        qo.append(qo[-1] + n - p)
        kv.append(kv[-1] + n)
    return StepInput(
        input_ids=torch.cat(ids),
        positions=torch.cat(pos),
        out_cache_loc=torch.cat(loc),
        qo_indptr=torch.tensor(qo, dtype=torch.int64),
        kv_indptr=torch.tensor(kv, dtype=torch.int64),
        kv_indices=torch.cat([s[: len(t)] for t, s in zip(prompts, slots)]),
    )
