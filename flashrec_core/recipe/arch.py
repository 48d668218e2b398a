"""Which architecture the recipe trains, and its HF config at the recipe's shape.

The core names no model family: the default architecture is the one whose plugin spec sets
`metadata["recipe_default"] = True` (the reference plugin does); `--arch` picks any other
installed one. The config starts from the spec's first example config, so family fields
(norm eps, rope, qk-norm, ...) come from the plugin, and only the shape is overridden.
"""

from __future__ import annotations

from typing import Any

from flashrec_core.registry import Registry
from flashrec_core.spec import ModelSpec

RECIPE_DEFAULT = "recipe_default"


def resolve_recipe_arch(
    arch: str | None, registry: Registry | None = None
) -> tuple[str, ModelSpec]:
    """(architecture, spec): `arch` when given, else the one plugin marked recipe_default."""
    registry = registry or Registry.discover()
    if arch is not None:
        return arch, registry.resolve(arch)
    marked = sorted(
        a for p in registry.plugins if p.spec and p.spec.metadata.get(RECIPE_DEFAULT)
        for a in p.spec.architectures[:1]
    )  # fmt: skip
    if len(marked) != 1:
        installed = ", ".join(registry.architectures()) or "none"
        raise LookupError(
            f"{len(marked)} installed plugins mark a default recipe architecture ({marked}); "
            f"pass --arch, one of: {installed}"
        )
    return marked[0], registry.resolve(marked[0])


def recipe_hf_config(
    spec: ModelSpec, arch: str, shape: Any, vocab_size: int, max_position: int, tok: Any
) -> dict[str, Any]:
    """The spec's first example config at `shape`; vocab rounded up to a multiple of 64."""
    if not spec.examples:
        raise ValueError(f"{arch}'s plugin spec has no example config to start a recipe from")
    cfg = dict(spec.examples[0].hf_config)
    cfg |= {
        "architectures": [arch], "vocab_size": -(-vocab_size // 64) * 64,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "max_position_embeddings": max_position, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }  # fmt: skip
    for key, value in (("num_key_value_heads", shape.num_kv_heads), ("head_dim", shape.head_dim)):
        if key in cfg:  # only families that have these fields
            cfg[key] = value
    return cfg
