"""Token embedding whose weight doubles as the LM head when embeddings are tied."""

from __future__ import annotations

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext


class Embedding(nn.Module):
    """Lookup of rows of `weight`; `scale` (e.g. sqrt(hidden_size)) multiplies the output.

    The scale is rounded to the model dtype first, as transformers does (`normalizer` is a
    tensor of the hidden states' dtype), so bf16 models match bit for bit. The LM head reads the
    unscaled `weight`.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, ctx: BuildContext, *, scale: float | None = None
    ) -> None:
        super().__init__()
        shape = (vocab_size, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, dtype=ctx.dtype, device=ctx.device), False)
        self.scale = None if scale is None else float(torch.tensor(scale, dtype=ctx.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = nn.functional.embedding(input_ids, self.weight)
        return out if self.scale is None else out * self.scale
