"""Reference constrained beam search in transformers, for parity with the engine's search.

`generate(num_beams=n, num_return_sequences=n)` with a LogitsProcessor that applies the same
normalization (over the current codebook level, or over all SID tokens) and the same trie
(every prefix of a catalog SID). HF hands processors log-softmax(full vocab) scores; a
log-softmax over a subset of those equals a log-softmax over the subset's raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashrec_core.search.sid_layout import SidLayout

DEAD = -1e8  # HF seeds unused beams with -1e9; anything below this is not a real beam


def catalog_children(codes: np.ndarray) -> dict[tuple[int, ...], list[int]]:
    """prefix -> sorted allowed next codes, for every prefix of every SID."""
    children: dict[tuple[int, ...], set[int]] = {}
    for row in codes.tolist():
        for d in range(len(row)):
            children.setdefault(tuple(row[:d]), set()).add(row[d])
    return {k: sorted(v) for k, v in children.items()}


class SidConstraint:
    """LogitsProcessor: renormalize over the SID level (or all SID tokens), mask by the trie."""

    def __init__(
        self,
        prompt_len: int,
        layout: SidLayout,
        children: dict[tuple[int, ...], list[int]] | None,
        normalization: str,
    ) -> None:
        self.prompt_len = prompt_len
        self.layout = layout
        self.children = children
        self.normalization = normalization

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        level = input_ids.shape[1] - self.prompt_len
        start, size = lay.level_starts[level], lay.level_sizes[level]
        if self.normalization == "level":
            level_lp = torch.log_softmax(scores[:, start : start + size].float(), dim=-1)
        else:
            sid_lp = torch.log_softmax(scores[:, lay.sid_start : lay.sid_end].float(), dim=-1)
            off = start - lay.sid_start
            level_lp = sid_lp[:, off : off + size]
        out = torch.full_like(scores, float("-inf"))
        for b in range(scores.shape[0]):
            allowed = self._allowed(input_ids[b, self.prompt_len :], level)
            if allowed is None:
                out[b, start : start + size] = level_lp[b]
            elif allowed:
                idx = torch.tensor(allowed)
                out[b, start + idx] = level_lp[b, idx]
        return out

    def _allowed(self, generated: torch.Tensor, level: int) -> list[int] | None:
        if self.children is None:
            return None
        codes = tuple(
            int(t) - self.layout.level_starts[d] for d, t in enumerate(generated.tolist())
        )
        return self.children.get(codes, [])


def hf_beam_search(
    model: Any,
    prompt_ids: Sequence[int],
    n: int,
    layout: SidLayout,
    catalog_codes: np.ndarray | None,
    normalization: str = "level",
) -> list[tuple[tuple[int, ...], float]]:
    """Ranked (codes, cumulative log-prob) of HF beam search; dead beams dropped."""
    from transformers import LogitsProcessorList

    children = catalog_children(catalog_codes) if catalog_codes is not None else None
    proc = SidConstraint(len(prompt_ids), layout, children, normalization)
    out = model.generate(
        torch.tensor([list(prompt_ids)]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=n, num_return_sequences=n, max_new_tokens=layout.depth, min_new_tokens=layout.depth,
        do_sample=False, **({} if n == 1 else {"length_penalty": 0.0, "early_stopping": True}),
        logits_processor=LogitsProcessorList([proc]), output_scores=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    if n == 1:  # transformers runs greedy search: no beam scores, sum the processed steps
        gen = out.sequences[0, len(prompt_ids) :]
        total = sum(float(step[0, tok]) for step, tok in zip(out.scores, gen.tolist()))
        scores = torch.tensor([total])
    else:
        scores = out.sequences_scores
    results = []
    for seq, score in zip(out.sequences, scores):
        if score.item() < DEAD:
            continue
        gen = seq[len(prompt_ids) :].tolist()
        codes = tuple(t - layout.level_starts[d] for d, t in enumerate(gen))
        results.append((codes, float(score)))
    return results


def assert_same_ranking(
    got: list[tuple[tuple[int, ...], float]],
    ref: list[tuple[tuple[int, ...], float]],
    atol_logprob: float = 1e-4,
    swap_tol: float = 1e-5,
) -> None:
    """Same SIDs in the same order, except swaps between beams whose scores differ < swap_tol;
    log-probs within atol_logprob."""
    assert len(got) == len(ref), f"{len(got)} results vs {len(ref)} from transformers"
    ref_scores = dict(ref)
    for i, ((g_codes, g_score), (r_codes, r_score)) in enumerate(zip(got, ref)):
        if g_codes != r_codes:
            assert abs(g_score - r_score) < swap_tol, (
                f"rank {i}: {g_codes} ({g_score:.6f}) vs transformers {r_codes} ({r_score:.6f})"
            )
            assert g_codes in ref_scores, f"rank {i}: {g_codes} is not among transformers' beams"
        assert abs(g_score - ref_scores.get(g_codes, r_score)) <= atol_logprob, (
            f"rank {i}: log-prob {g_score:.6f} vs {ref_scores.get(g_codes, r_score):.6f}"
        )


def assert_same_beams_within(
    a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float], tol: float
) -> None:
    """Two searches of one request whose scores differ by noise of at most `tol` (codes ->
    log-prob of each returned beam): shared SIDs score within tol, and a SID only one of them
    returned scores below the other's last beam + tol (it lost its place at the cut only to
    noise). Beams may swap ranks freely within that."""
    for codes in a.keys() & b.keys():
        assert abs(a[codes] - b[codes]) < tol, f"{codes}: {a[codes]:.4f} vs {b[codes]:.4f}"
    for only, cut in (
        (a.keys() - b.keys(), min(b.values())),
        (b.keys() - a.keys(), min(a.values())),
    ):
        for codes in only:
            score = a.get(codes, b.get(codes))
            assert score < cut + tol, f"{codes} ({score:.4f}) lost above the cut {cut:.4f}"


def assert_searches_alike(engines: Sequence[Any], tol: float, requests: int, n: int) -> None:
    """The same `requests` prompts of width n through each engine: every pair of searches as
    `assert_same_beams_within` allows (engines differing only in a kernel's rounding)."""
    results = []
    for engine in engines:
        reqs = [
            engine.make_request(prompt=f"user w{i} w{i + 2} item", n=n) for i in range(requests)
        ]
        results.append(engine.generate(reqs))
    for first, other in zip(results[0], results[1]):
        assert_same_beams_within(
            {c.codes: c.logprob for c in first.choices},
            {c.codes: c.logprob for c in other.choices},
            tol,
        )


@torch.inference_mode()
def teacher_forced_logprob(
    model: Any, prompt_ids: Sequence[int], layout: SidLayout, codes: Sequence[int],
    normalization: str = "level",
) -> float:  # fmt: skip
    """Exact cumulative log-prob of one SID after a prompt (one HF forward, no search)."""
    tokens = [layout.token_id(d, c) for d, c in enumerate(codes)]
    logits = model(torch.tensor([list(prompt_ids) + tokens])).logits[0].float()
    total = 0.0
    for d, code in enumerate(codes):
        row = logits[len(prompt_ids) - 1 + d]
        start, size = layout.level_starts[d], layout.level_sizes[d]
        if normalization == "level":
            lp = torch.log_softmax(row[start : start + size], dim=-1)[code]
        else:
            lp = torch.log_softmax(row[layout.sid_start : layout.sid_end], dim=-1)[
                start - layout.sid_start + code
            ]
        total += float(lp)
    return total
