"""The two-level (cascade) view of a beam decode step, and the flat per-row view derived from it."""

from __future__ import annotations

import torch

from flashrec_core.engine.beam_wave import prepare_beam_decode


def test_flat_indices_are_prompt_then_ancestors_then_own_slot() -> None:
    prompts = [torch.tensor([10, 11, 12]), torch.tensor([20, 21])]
    row_request = torch.tensor([0, 0, 1, 1, 1])
    history = torch.tensor([[30, 31], [32, 33], [34, 35], [36, 37], [38, 39]])
    own = torch.tensor([40, 41, 42, 43, 44])
    step = prepare_beam_decode(
        tokens=torch.zeros(5, dtype=torch.int64), positions=torch.zeros(5, dtype=torch.int64),
        prompts=torch.cat(prompts), prompt_lens=torch.tensor([3, 2]), row_request=row_request,
        history=history, own=own,
    )  # fmt: skip
    expected = [
        torch.cat([prompts[int(r)], history[i], own[i : i + 1]]) for i, r in enumerate(row_request)
    ]
    assert torch.equal(step.flat_kv_indices(), torch.cat(expected))
    assert step.kv_indptr.tolist() == [0, 6, 12, 17, 22, 27]  # 3 + 3 per row, then 2 + 3
    sp = step.shared_prefix
    assert sp.prefix_qo_indptr.tolist() == [0, 2, 5] and sp.prefix_kv_indptr.tolist() == [0, 3, 5]
    assert sp.suffix_kv_indptr.tolist() == [0, 3, 6, 9, 12, 15]
    assert torch.equal(sp.suffix_kv_indices, torch.cat([history, own[:, None]], 1).flatten())


def test_first_decode_step_has_no_history() -> None:
    step = prepare_beam_decode(
        tokens=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64),
        prompts=torch.tensor([5, 6, 7]), prompt_lens=torch.tensor([3]),
        row_request=torch.tensor([0, 0]), history=torch.empty(2, 0, dtype=torch.int64),
        own=torch.tensor([8, 9]),
    )  # fmt: skip
    assert step.flat_kv_indices().tolist() == [5, 6, 7, 8, 5, 6, 7, 9]
