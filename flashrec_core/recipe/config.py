"""Every setting of a recipe build, validated once (pydantic, frozen) and written to recipe.json,
from which `flashrec eval` reads the data source and history length back."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from flashrec_core.recipe.rqkmeans import CollisionRule
from flashrec_core.recipe.source import Source


class ModelShape(BaseModel):
    """The shape of the trained model (the architecture comes from `recipe.arch`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(default=64, gt=0)
    num_layers: int = Field(default=2, gt=0)
    num_heads: int = Field(default=4, gt=0)
    num_kv_heads: int = Field(default=2, gt=0)
    head_dim: int = Field(default=64, gt=0)
    """64: a head size every attention backend compiles for (FlashInfer: 64, 128, 256)."""
    intermediate_size: int = Field(default=256, gt=0)


class TrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: int = Field(default=8, gt=0)
    batch_size: int = Field(default=128, gt=0)
    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    warmup_steps: int = Field(default=100, ge=0)
    seed: int = 0
    threads: int = Field(default=1, gt=0)
    """torch threads while training; results are bit-identical only for the same count."""


class RecipeConfig(BaseModel):
    """Every choice of a build; written to recipe.json, read back by `flashrec eval`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Source
    arch: str | None = None
    """Architecture to train; None: the plugin marked recipe_default (see recipe/arch.py)."""
    embeddings: str = "cooc"
    """"cooc" (PPMI co-occurrence + SVD), "mf" (SVD of user x item), or a .npy file."""
    embedding_ids: str | None = None
    embedding_dim: int = Field(default=32, gt=0)
    window: int = Field(default=5, gt=0)
    levels: int = Field(default=3, ge=1, le=5)
    codebook_size: int = Field(default=16, ge=2)
    collision: CollisionRule = "auto"
    max_history: int = Field(default=20, gt=0)
    model: ModelShape = ModelShape()
    train: TrainConfig = TrainConfig()
