"""The HF transformers baseline: the same model shape and prompts through `generate` beam search
(BF16, sdpa, batched, open vocabulary), timed with CUDA events."""

from __future__ import annotations

from typing import Any

import torch

from flashrec_core.engine.requests import GenerationRequest


@torch.inference_mode()
def hf_requests_per_s(
    shape: dict[str, Any], requests: list[GenerationRequest], n: int, batch: int, depth: int
) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(shape["model_type"], **cfg)
    config._attn_implementation = "sdpa"
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([list(r.prompt_ids) for r in requests], device="cuda")

    def run(chunk: torch.Tensor) -> None:
        hf_model.generate(
            chunk, attention_mask=torch.ones_like(chunk), num_beams=n, num_return_sequences=n,
            max_new_tokens=depth, min_new_tokens=depth, do_sample=False, pad_token_id=0,
        )  # fmt: skip

    run(ids[:batch])  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(0, len(requests), batch):
        run(ids[i : i + batch])
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    hf_model.cpu()
    torch.cuda.empty_cache()
    return len(requests) / seconds
