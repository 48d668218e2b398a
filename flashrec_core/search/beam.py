"""One step of exact constrained beam search, as pure tensor ops (no host sync).

Rows are beams of several requests laid out back to back: request r owns rows
[row_offset[r], row_offset[r] + width[r]). Each step scores every valid trie child of every row
(parent score + step log-prob; invalid children are -inf *before* selection), then takes the
global top-width[r] of each request. Ties break deterministically: lower parent row, then lower
child slot (lower code). Both top-k stages order unique int64 packed keys (no sort); the first
(mask + score + per-row top-k) is `flashrec_kernels.trie_topk`, fused in Triton on the GPU.
With temperature > 0 the selection key gets Gumbel noise (sampling without replacement per step)
while the reported score stays the true cumulative log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrec_core.search.trie import Trie
from flashrec_kernels import TrieTopK, stable_topk, trie_topk, trie_topk_ref

NEG_INF = float("-inf")


@dataclass(frozen=True)
class BeamLayout:
    """Static shape of a wave: which request each row belongs to. Built once per wave."""

    widths: torch.Tensor  # [B] beams per request
    row_request: torch.Tensor  # [R] request of each row
    row_rank: torch.Tensor  # [R] beam index within its request
    max_width: int

    @classmethod
    def create(cls, widths: list[int], device: torch.device) -> BeamLayout:
        w = torch.tensor(widths, dtype=torch.int64)
        row_request = torch.repeat_interleave(torch.arange(len(widths)), w)
        offsets = torch.cumsum(w, 0) - w
        row_rank = torch.arange(int(w.sum())) - offsets[row_request]
        # non_blocking: a blocking host-to-device copy waits for all queued GPU work
        copy = {"device": device, "non_blocking": True}
        return cls(w.to(**copy), row_request.to(**copy), row_rank.to(**copy), max(widths))

    @property
    def num_rows(self) -> int:
        return self.row_request.shape[0]

    @property
    def row_offsets(self) -> torch.Tensor:
        return torch.cumsum(self.widths, 0) - self.widths


@dataclass(frozen=True)
class Selection:
    """The new beams, one per row: which parent row they extend, with which code."""

    parent: torch.Tensor  # [R] parent row (global row index)
    code: torch.Tensor  # [R] code chosen at this level
    node: torch.Tensor  # [R] trie node at the next level (catalog row after the last level)
    score: torch.Tensor  # [R] cumulative log-prob (-inf: no valid beam for this row)


def expand_beams(
    trie: Trie,
    level: int,
    nodes: torch.Tensor,
    parent_score: torch.Tensor,
    log_probs: torch.Tensor,
    parents: BeamLayout,
    out: BeamLayout,
    noise: torch.Tensor | None = None,
    *,
    use_kernel: bool = False,
) -> Selection:
    """One step: trie mask + score + per-row top-k (`flashrec_kernels.trie_topk`), then the
    global top-width of each request. No [R, W] tensor is built when `use_kernel` is set.

    `nodes` int64 [R_in] and `parent_score` fp32 [R_in] are the parent beams (laid out by
    `parents`), `log_probs` fp32 [R_in, K] the step's log-probs, `noise` fp32 [R_in, W] or None.
    `use_kernel` picks the Triton kernel over the torch reference; decide it once per engine
    (CUDA, or `triton_on_cpu` under the interpreter), not per step.
    """
    k_row = min(trie.max_children(level), out.max_width)
    topk = trie_topk if use_kernel else trie_topk_ref
    rows = topk(trie.kernel_level(level), nodes, parent_score, log_probs, k_row, noise)
    return select_from_rows(rows, parents, out)


def select_from_rows(rows: TrieTopK, parents: BeamLayout, out: BeamLayout) -> Selection:
    """Global top-width of each request over its parent rows' k best candidates.

    A request with fewer valid candidates than its width gets dead beams (score -inf) pointing
    at its first parent row (code and node of that row's best slot: in range, otherwise unused).
    Ties break by lower parent row, then by the row's own order (lower slot first).
    """
    num_req, k_row = out.widths.shape[0], rows.key.shape[1]
    # [B, P * k_row] candidates per request, at least max_width wide (short ones pad -inf)
    cols = max(parents.max_width * k_row, out.max_width)
    grid = rows.key.new_full((num_req, cols), NEG_INF)
    flat_pos = parents.row_rank[:, None] * k_row + torch.arange(k_row, device=grid.device)
    grid[parents.row_request[:, None], flat_pos] = rows.key
    top_keys, flat = stable_topk(grid, out.max_width)  # [B, max_width]
    # Output row (r, j) takes request r's j-th best candidate.
    key = top_keys[out.row_request, out.row_rank]
    flat_row = flat[out.row_request, out.row_rank]
    dead = key == NEG_INF
    parent = parents.row_offsets[out.row_request] + torch.where(dead, 0, flat_row // k_row)
    rank = torch.where(dead, 0, flat_row % k_row)
    score = rows.score[parent, rank].masked_fill(dead, NEG_INF)
    return Selection(parent, rows.code[parent, rank], rows.child[parent, rank], score)


def gumbel_noise(
    rows_per_request: list[int],
    width: int,
    generators: list[torch.Generator | None],
    temperatures: list[float],
    device: torch.device,
) -> torch.Tensor:
    """Selection noise [R, W]: T_r * Gumbel(0,1) from request r's own seeded generator.

    Keys are score + T * G, which ranks like score / T + G but keeps scores in log-prob units.
    Requests at temperature 0 get zeros (deterministic top-k).
    """
    parts = []
    for rows, gen, temp in zip(rows_per_request, generators, temperatures):
        if temp <= 0 or gen is None:
            parts.append(torch.zeros((rows, width), dtype=torch.float64))
            continue
        u = torch.rand((rows, width), generator=gen, dtype=torch.float64)
        parts.append(-torch.log(-torch.log(u.clamp(1e-300, 1.0 - 1e-16))) * temp)
    return torch.cat(parts).to(torch.float32).to(device, non_blocking=True)
