"""Tiny GenRec checkpoints built offline: an HF config, random safetensors weights made by
`transformers`, and a real HF tokenizer whose added tokens carry the SID codebooks."""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Mapping, Sequence
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


NormIdentity = Callable[[str], "float | None"]
"""checkpoint tensor name -> the stored value of a norm weight that only normalizes (1.0 for
`weight * x`, 0.0 for `(1 + weight) * x`), or None when the tensor is not a norm weight."""


def _name_heuristic(name: str) -> float | None:
    """Fallback for norms whose layer declares no `identity_weight` (v1 plugins)."""
    parts = name.split(".")
    if name.endswith("norm.weight") or "layernorm" in name or "ln" in parts:
        return 1.0 if name.endswith("weight") else None
    return None


def build_hf_model(
    hf_config: Mapping[str, Any], seed: int = 0, init_std: float = 0.1,
    norm_identity: NormIdentity | None = None,
):  # fmt: skip
    """A random-weight transformers model from a config dict (no download).

    init_std is larger than HF's 0.02 so that tiny models have peaked next-token distributions:
    near-uniform log-probs would make beam rankings hinge on 1e-6 differences. Norm weights are
    drawn around each norm's own identity (`norm_identity`, from the spec's layers), so a gain
    stays near 1 whichever way a family stores it, and a missing norm is still visible.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **cfg)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    identity = norm_identity or _name_heuristic
    with torch.no_grad():
        for name, p in model.named_parameters():
            center = identity(name)
            if center is not None:
                p.copy_(center + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def write_published_config(path: Path, hf_config: Mapping[str, Any], dtype: torch.dtype) -> None:
    """config.json as a published checkpoint has it: the example's keys and the dtype, not every
    default transformers would fill in, so the spec's parser meets its own defaults."""
    name = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": name}, indent=2))


def write_tiny_checkpoint(
    path: str | Path,
    hf_config: Mapping[str, Any],
    *,
    level_sizes: Sequence[int] = (16, 16, 16),
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    boundary: bool = True,
    chat: bool = True,
    norm_identity: NormIdentity | None = None,
):
    """Write config.json + model.safetensors + tokenizer files; returns the HF model (fp32)."""
    path = Path(path)
    tokenizer = build_tokenizer(level_sizes, boundary=boundary, chat=chat)
    if len(tokenizer) > hf_config["vocab_size"]:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but vocab_size is {hf_config['vocab_size']}"
        )
    model = build_hf_model(hf_config, seed=seed, norm_identity=norm_identity)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    write_published_config(path, hf_config, dtype)
    tokenizer.save_pretrained(path)
    model.float()
    return model


def spec_norm_identity(spec: Any, hf_config: Mapping[str, Any]) -> NormIdentity:
    """The identity value of each checkpoint norm weight, as the spec's own layers declare it
    (`identity_weight` on the module a tensor loads into); the name heuristic otherwise."""
    from flashrec_core.config import EngineConfig
    from flashrec_core.engine import create_build_context
    from flashrec_core.loader import WeightLoader

    config = spec.parse_config(hf_config)
    cfg = EngineConfig(
        model_path="<none>", device="cpu", dtype="float32", quantization="none",
        kv_cache_dtype="float32", attention_backend="torch",
    )  # fmt: skip
    ctx, _ = create_build_context(spec, cfg)
    model = spec.load_model_class()(config, ctx)
    loader = WeightLoader(model, spec, config)
    modules = dict(model.named_modules())

    def identity(name: str) -> float | None:
        if not name.endswith(".weight") or loader.hook_for(name) is not None:
            return None
        module = modules.get(loader.target(name).module)
        declared = getattr(module, "identity_weight", None)
        return float(declared) if declared is not None else _name_heuristic(name)

    return identity


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


GPU_HEAD_DIM = 64


def gpu_shape(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A tiny example config at head_dim 64 for the GPU tier: FlashInfer compiles kernels for head
    dims 64, 128 and 256 (the CPU tier's head_dim 16 suits the torch backend only). A partial
    rotary factor is moved to the nearest one that rotates an even number of dims at head_dim 64
    (0.4 of 64 is 25.6, which no rotate-half RoPE can use; a published head_dim of 80 gives 32)."""
    shaped = {**hf_config, "hidden_size": 256, "num_attention_heads": 4,
              "head_dim": GPU_HEAD_DIM, "intermediate_size": 512}  # fmt: skip
    if shaped.get("partial_rotary_factor") is not None:
        shaped["partial_rotary_factor"] = _even_rotary_factor(shaped["partial_rotary_factor"])
    rope = shaped.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        factor = _even_rotary_factor(rope["partial_rotary_factor"])
        shaped["rope_parameters"] = {**rope, "partial_rotary_factor": factor}
    return shaped


def _even_rotary_factor(factor: float) -> float:
    rotary_dims = max(2, 2 * round(float(factor) * GPU_HEAD_DIM / 2))
    return rotary_dims / GPU_HEAD_DIM
