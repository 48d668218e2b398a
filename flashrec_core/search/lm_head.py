"""The restricted LM head: GenRec only ever scores SID tokens.

Instead of multiplying by all ~150k rows of `lm_head()`, step d multiplies by codebook d's rows
(a zero-copy slice: levels are contiguous in the vocabulary). Normalization is explicit:

| normalization | log-probs of step d are a log-softmax over ...                    |
| ------------- | ----------------------------------------------------------------- |
| "level"       | codebook d's tokens only (default; one small GEMM per step)        |
| "sid"         | every SID codebook token (all levels), then sliced to codebook d   |

The trie mask is applied afterwards and does not renormalize. A final-logit soft-cap c
(`ModelConfig.final_logit_softcap`, e.g. 30) turns each logit z into c * tanh(z / c) first, as the
model's own head does before any softmax.
"""

from __future__ import annotations

from typing import Literal

import torch

from flashrec_core.search.sid_layout import SidLayout

Normalization = Literal["level", "sid"]


class RestrictedLMHead:
    """Per-level log-probs from final hidden states; holds views of the model's head weight."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layout: SidLayout,
        normalization: Normalization = "level",
        logit_softcap: float | None = None,
    ) -> None:
        if normalization not in ("level", "sid"):
            raise ValueError(f"sid normalization must be 'level' or 'sid', got {normalization!r}")
        if weight.shape[0] < layout.sid_end:
            raise ValueError(
                f"LM head has {weight.shape[0]} rows but SID tokens reach id {layout.sid_end - 1}"
            )
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"final logit soft-cap must be None or > 0, got {logit_softcap!r}")
        self.layout = layout
        self.normalization = normalization
        self.logit_softcap = logit_softcap
        # NOTE: slices of the head's storage, taken once: CUDA graphs replay these addresses.
        self.sid_weight = weight[layout.sid_start : layout.sid_end]
        self.sid_bias = None if bias is None else bias[layout.sid_start : layout.sid_end]
        self.offsets = [s - layout.sid_start for s in layout.level_starts]

    def _rows(self, level: int) -> slice:
        start = self.offsets[level]
        return slice(start, start + self.layout.level_sizes[level])

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def logits(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """Logits [R, K_level] (fp32, soft-capped when the model caps) of codebook `level`."""
        rows = self._rows(level)
        out = hidden @ self.sid_weight[rows].t()
        if self.sid_bias is not None:
            out = out + self.sid_bias[rows]
        return self._cap(out.float())

    def log_probs(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """Normalized log-probs [R, K_level] (fp32) of codebook `level`."""
        if self.normalization == "level":
            return torch.log_softmax(self.logits(hidden, level), dim=-1)
        out = hidden @ self.sid_weight.t()
        if self.sid_bias is not None:
            out = out + self.sid_bias
        return torch.log_softmax(self._cap(out.float()), dim=-1)[:, self._rows(level)]
