"""Training a small causal LM on "history -> next item's SID" (CPU, torch).

Examples are history item tokens + <|sid_begin|> + the target's SID codes; the loss is the
cross-entropy of each code over its own codebook level's tokens, the engine's default
`--sid-normalization level`, so training and constrained search score the same distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashrec_core.recipe.config import TrainConfig
from flashrec_core.recipe.rqkmeans import SemanticIds
from flashrec_core.recipe.tokenizer import SID_BEGIN, history_prompt
from flashrec_core.search.sid_layout import SidLayout


@dataclass(frozen=True)
class Example:
    prompt_ids: tuple[int, ...]  # history item tokens + <|sid_begin|>
    codes: tuple[int, ...]


def build_model(hf_config: dict, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(hf_config["model_type"], **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train(
    model: torch.nn.Module,
    examples: Sequence[Example],
    layout: SidLayout,
    cfg: TrainConfig,
    progress: bool = True,
) -> list[float]:
    """AdamW with warmup + cosine decay; returns the mean loss of each epoch."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    steps = cfg.epochs * math.ceil(len(examples) / cfg.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup_steps, steps))
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress)
    epoch_losses = []
    model.train()
    try:
        for _ in range(cfg.epochs):
            total = 0.0
            order = rng.permutation(len(examples))
            for start in range(0, len(order), cfg.batch_size):
                batch = [examples[i] for i in order[start : start + cfg.batch_size]]
                loss = sid_loss(model, batch, layout)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                total += loss.item() * len(batch)
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.4f}")
            epoch_losses.append(total / len(examples))
    finally:
        bar.close()
        model.eval()
        torch.set_num_threads(threads)
    return epoch_losses


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def sid_loss(model: torch.nn.Module, batch: Sequence[Example], layout: SidLayout) -> torch.Tensor:
    """Mean per-level cross-entropy of the SID codes after each prompt (right-padded batch)."""
    ids, mask, first = _pad(batch, layout)
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    weight = model.get_output_embeddings().weight  # [V, H]
    rows = torch.arange(len(batch))
    losses = []
    for lvl in range(layout.depth):
        start = layout.level_starts[lvl]
        logits = hidden[rows, first + lvl] @ weight[start : start + layout.level_sizes[lvl]].T
        target = torch.tensor([ex.codes[lvl] for ex in batch])
        losses.append(torch.nn.functional.cross_entropy(logits, target))
    return torch.stack(losses).mean()


def _pad(batch: Sequence[Example], layout: SidLayout) -> tuple[torch.Tensor, ...]:
    """input ids = prompt + all codes but the last; `first` = index predicting code 0."""
    seqs = [
        list(ex.prompt_ids) + [layout.token_id(lv, c) for lv, c in enumerate(ex.codes[:-1])]
        for ex in batch
    ]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
    first = torch.tensor([len(ex.prompt_ids) - 1 for ex in batch])
    return ids, mask, first


def training_examples(
    train_seqs: dict[str, list[str]], items: list[str], sids: SemanticIds, tok: Any, history: int
) -> list[Example]:
    """One example per training step t >= 1 of every user: items[:t] (last `history`) -> item t."""
    row = {item: r for r, item in enumerate(items)}
    token = {item: tok.convert_tokens_to_ids(item) for item in items}
    begin = tok.convert_tokens_to_ids(SID_BEGIN)
    examples = []
    for seq in train_seqs.values():
        for t in range(1, len(seq)):
            prompt = tuple(token[i] for i in seq[max(0, t - history) : t]) + (begin,)
            examples.append(Example(prompt, tuple(sids.codes[row[seq[t]]].tolist())))
    if not examples:
        raise ValueError("the log gives no training example: every user needs >= 2 train items")
    probe = history_prompt(list(train_seqs.values())[0], history)
    assert len(tok(probe, add_special_tokens=False)["input_ids"]) == len(probe.split()), (
        "each item id must be one token, as the engine will tokenize the prompt"
    )
    return examples
