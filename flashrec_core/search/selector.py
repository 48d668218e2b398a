"""One beam step's selection after the forward: restricted LM head -> per-request item filter
masks -> trie mask + top-k -> beam expansion.

The eager beam step and the captured CUDA graph of a step run the same `BeamSelector.select`;
the graph runner holds the selector itself, so it never calls back into the search loop.
"""

from __future__ import annotations

import torch

from flashrec_core.search.beam import BeamLayout, Selection, expand_beams
from flashrec_core.search.filters import FilterMasks
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.trie import Trie


class BeamSelector:
    def __init__(self, head: RestrictedLMHead, use_kernel: bool) -> None:
        self.head = head
        self.use_kernel = use_kernel
        """The fused trie-mask + top-k Triton kernel (else its torch reference); decided once
        per engine."""

    def select(
        self,
        trie: Trie,
        level: int,
        hidden: torch.Tensor,
        parent_score: torch.Tensor,
        nodes: torch.Tensor,
        parents: BeamLayout,
        out: BeamLayout,
        noise: torch.Tensor | None = None,
        masks: FilterMasks | None = None,
    ) -> Selection:
        """The `out` beams chosen among the children of `parents`' rows at `level` (hidden
        [R, H] of those rows; `noise` [R, W] for sampling, None for greedy)."""
        log_probs = self.head.log_probs(hidden, level)
        if masks is not None:
            log_probs = masks.apply(trie, level, nodes, parents.row_request, log_probs)
        return expand_beams(
            trie, level, nodes, parent_score.float(), log_probs, parents, out, noise,
            use_kernel=self.use_kernel,
        )  # fmt: skip
