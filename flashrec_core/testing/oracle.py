"""Reference computations the conformance suite compares against (transformers on CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flashrec_core.config import EngineConfig
from flashrec_core.engine import ModelRunner, StepInput, prepare_prefill


def hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_logits(model: Any, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per-prompt full logits [L, V] from transformers, one unpadded forward each."""
    return [model(torch.tensor([list(p)])).logits[0].float() for p in prompts]


def create_runner(path: str | Path, **overrides: Any) -> ModelRunner:
    settings: dict[str, Any] = {
        "model_path": str(path), "device": "cpu", "kv_cache_tokens": 8192, "max_requests": 64,
        "show_progress": False,
    }  # fmt: skip
    settings.update(overrides)
    return ModelRunner.from_config(EngineConfig(**settings))


def engine_prefill_logits(
    runner: ModelRunner, prompts: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Logits for every prompt token through one batched prefill over the KV pool."""
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    try:
        hidden = runner.forward(prepare_prefill([list(p) for p in prompts], slots))
        logits = runner.logits(hidden)
    finally:
        for s in slots:
            runner.allocator.free(s)
    return list(logits.split([len(p) for p in prompts]))


def engine_decode_logits(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Prefill the prompts, then feed continuation tokens one step at a time (all sequences in
    one decode batch per step); returns per-sequence logits [steps, V] of the decode steps."""
    seqs = [list(p) for p in prompts]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    try:
        runner.forward(prepare_prefill(seqs, slots))
        steps = len(continuations[0])
        out: list[list[torch.Tensor]] = [[] for _ in prompts]
        for t in range(steps):
            new = [runner.allocator.alloc(1) for _ in prompts]
            slots = [torch.cat([s, n]) for s, n in zip(slots, new)]
            step = _decode_step([c[t] for c in continuations], [len(s) for s in slots], slots)
            logits = runner.logits(runner.forward(step))
            for i in range(len(prompts)):
                out[i].append(logits[i])
        return [torch.stack(o) for o in out]
    finally:
        for s in slots:
            runner.allocator.free(s)


def _decode_step(tokens: list[int], lengths: list[int], slots: list[torch.Tensor]) -> StepInput:
    n = len(tokens)
    kv_indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return StepInput(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor([ln - 1 for ln in lengths], dtype=torch.int64),
        out_cache_loc=torch.stack([s[-1] for s in slots]),
        qo_indptr=torch.arange(n + 1, dtype=torch.int64),
        kv_indptr=kv_indptr,
        kv_indices=torch.cat(slots),
    )


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, rel: float, what: str) -> None:
    """max |got - ref| <= rel * max |ref|: a bound relative to the logits' scale."""
    diff = (got.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert diff <= rel * scale, f"{what}: max abs diff {diff:.3g} > {rel} x max|ref| {scale:.3g}"
