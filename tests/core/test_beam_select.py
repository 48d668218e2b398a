"""Beam selection: expand_beams (reference and Triton kernel) equals the former sort-based code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrec_core.search.beam import BeamLayout, Selection, expand_beams
from flashrec_core.search.trie import Trie, TrieChildren, build_trie
from flashrec_core.search.unconstrained import UnconstrainedTrie

SIZES = (13, 11, 7)
NEG_INF = float("-inf")


def candidate_scores(
    parent_score: torch.Tensor, log_probs: torch.Tensor, children: TrieChildren
) -> torch.Tensor:
    """[R, W] cumulative scores of every child slot; invalid children are -inf (the oracle's
    materialized candidates; the engine never builds this tensor)."""
    step = log_probs.gather(1, children.codes).masked_fill(~children.valid, NEG_INF)
    return parent_score[:, None] + step


def sorted_select(
    scores: torch.Tensor,
    children: TrieChildren,
    parents: BeamLayout,
    out: BeamLayout,
    noise: torch.Tensor | None,
) -> Selection:
    """Beam selection as it was before the packed-key top-k: two stable torch.sorts (the oracle)."""

    def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], index[..., :k]

    num_req, width = out.widths.shape[0], scores.shape[1]
    keys = scores if noise is None else scores + noise
    k_row = min(width, out.max_width)
    row_keys, row_pos = stable_topk(keys, k_row)
    cols = max(parents.max_width * k_row, out.max_width)
    grid = keys.new_full((num_req, cols), NEG_INF)
    flat_pos = parents.row_rank[:, None] * k_row + torch.arange(k_row, device=keys.device)
    grid[parents.row_request[:, None], flat_pos] = row_keys
    top_keys, flat = stable_topk(grid, out.max_width)
    key = top_keys[out.row_request, out.row_rank]
    flat_row = flat[out.row_request, out.row_rank]
    dead = key == NEG_INF
    parent = parents.row_offsets[out.row_request] + torch.where(dead, 0, flat_row // k_row)
    pos = torch.where(dead, 0, row_pos[parent, flat_row % k_row])
    score = scores[parent, pos].masked_fill(dead, NEG_INF)
    return Selection(parent, children.codes[parent, pos], children.child[parent, pos], score)


def make_trie(kind: str) -> Trie:
    if kind == "unconstrained":
        return UnconstrainedTrie(SIZES)
    rng = np.random.default_rng(0)
    codes = np.unique(np.stack([rng.integers(0, k, 150) for k in SIZES], axis=1), axis=0)
    return build_trie(codes, SIZES, kind=kind)


def assert_same_beams(got: Selection, want: Selection) -> None:
    """Equal parents and scores; codes and nodes where the beam is alive (dead ones: unused)."""
    assert torch.equal(got.parent, want.parent) and torch.equal(got.score, want.score)
    alive = want.score > NEG_INF
    assert torch.equal(got.code[alive], want.code[alive])
    assert torch.equal(got.node[alive], want.node[alive])


@pytest.mark.parametrize("kind", ["dense", "csr", "unconstrained"])
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_expand_beams_equals_sorted_selection(kind: str, noise: bool, use_kernel: bool) -> None:
    """Three levels of a search with ties (coarse log-probs), a dead parent and mixed widths.
    The kernel runs on CUDA when present, else in the Triton interpreter (tests/conftest.py)."""
    if use_kernel:
        pytest.importorskip("triton")
    dev = torch.device("cuda" if use_kernel and torch.cuda.is_available() else "cpu")
    trie, gen = make_trie(kind).to(dev), torch.Generator().manual_seed(1)
    widths = [3, 1, 5, 12]
    first, beams = BeamLayout.create([1] * len(widths), dev), BeamLayout.create(widths, dev)
    nodes, parent_score, parents = torch.zeros(4, dtype=torch.int64), torch.zeros(4), first
    nodes, parent_score = nodes.to(dev), parent_score.to(dev)
    for level in range(trie.depth):
        rows, width = parents.num_rows, trie.max_children(level)
        log_probs = ((torch.randn(rows, SIZES[level], generator=gen) * 4).round() / 4 - 2).to(dev)
        extra = (torch.rand(rows, width, generator=gen) * 4).round().to(dev) / 4 if noise else None
        children = trie.children(level, nodes)
        scores = candidate_scores(parent_score, log_probs, children)
        want = sorted_select(scores, children, parents, beams, extra)
        got = expand_beams(trie, level, nodes, parent_score, log_probs, parents, beams, extra,
                           use_kernel=use_kernel)  # fmt: skip
        assert_same_beams(got, want)
        nodes, parent_score, parents = got.node, got.score, beams
        if level == 0:
            parent_score = parent_score.clone()
            parent_score[1] = NEG_INF  # a dead beam: its children are never chosen
