"""Tiny GenRec checkpoints built offline: an HF config, random safetensors weights made by
`transformers`, and a real HF tokenizer whose added tokens carry the SID codebooks."""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

BASE_WORDS = [f"w{i}" for i in range(48)] + ["user", "history", "item", "next", "recommend"]
SPECIAL = ["[PAD]", "[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def sid_token(level: int, code: int) -> str:
    return f"<s_{string.ascii_lowercase[level]}_{code}>"


def build_tokenizer(level_sizes: Sequence[int], *, boundary: bool = True, chat: bool = True):
    """A word-level HF tokenizer: special tokens, a small word vocab, then the SID tokens
    (levels back to back, contiguous ids), then <|sid_begin|> / <|sid_end|>."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + BASE_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    sid = [sid_token(lv, c) for lv, size in enumerate(level_sizes) for c in range(size)]
    tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in sid])
    if boundary:
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t in ("<|sid_begin|>", "<|sid_end|>")
            ]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_hf_model(hf_config: Mapping[str, Any], seed: int = 0, init_std: float = 0.1):
    """A random-weight transformers model from a config dict (no download).

    init_std is larger than HF's 0.02 so that tiny models have peaked next-token distributions:
    near-uniform log-probs would make beam rankings hinge on 1e-6 differences.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **cfg)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1.0 in HF; randomize so a missing norm is visible
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "ln" in name.split("."):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def write_tiny_checkpoint(
    path: str | Path,
    hf_config: Mapping[str, Any],
    *,
    level_sizes: Sequence[int] = (16, 16, 16),
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    boundary: bool = True,
    chat: bool = True,
):
    """Write config.json + model.safetensors + tokenizer files; returns the HF model (fp32)."""
    path = Path(path)
    tokenizer = build_tokenizer(level_sizes, boundary=boundary, chat=chat)
    if len(tokenizer) > hf_config["vocab_size"]:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but vocab_size is {hf_config['vocab_size']}"
        )
    model = build_hf_model(hf_config, seed=seed)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.float()
    return model


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def gpu_shape(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A tiny example config at head_dim 64 for the GPU tier: FlashInfer compiles kernels for head
    dims 64, 128 and 256 (the CPU tier's head_dim 16 suits the torch backend only)."""
    return {**hf_config, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
            "intermediate_size": 512}  # fmt: skip
