"""Token embedding whose weight doubles as the LM head when embeddings are tied."""

from __future__ import annotations

import torch
from torch import nn

from flashrec_core.layers.context import BuildContext


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext) -> None:
        super().__init__()
        shape = (vocab_size, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, dtype=ctx.dtype, device=ctx.device), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)
