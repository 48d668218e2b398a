"""trie_topk: the reference against a stable sort, the Triton kernel against the reference (exact)."""

from __future__ import annotations

import pytest
import torch

import flashrec_kernels.triton_trie_topk as triton_trie_topk
from flashrec_kernels import (
    CsrLevel,
    DenseLevel,
    TrieTopK,
    pack_keys,
    stable_topk,
    trie_topk,
    trie_topk_ref,
)

NEG_INF = float("-inf")
K_CODES = 37  # codebook size; non-power-of-two like every width below
CSR_WIDTH = 23


def _quantized(shape: tuple[int, ...], gen: torch.Generator, step: float) -> torch.Tensor:
    """Values on a coarse grid, so that many keys tie exactly."""
    return (torch.randn(shape, generator=gen) * 2 / step).round() * step


def dense_level(gen: torch.Generator, num_nodes: int = 9, codes: int = K_CODES) -> DenseLevel:
    present = torch.rand(num_nodes, codes, generator=gen) < 0.4
    present[0], present[1] = False, True  # a node without children, a node with every code
    ids = torch.randint(0, 1000, (num_nodes, codes), generator=gen)
    return DenseLevel(torch.where(present, ids, -1).int())


def csr_level(gen: torch.Generator, num_nodes: int = 9, width: int = CSR_WIDTH) -> CsrLevel:
    degree = torch.randint(0, width + 1, (num_nodes,), generator=gen)
    degree[0], degree[1] = width, 0  # the widest node, a node without children
    codes = [torch.randperm(K_CODES, generator=gen)[: int(d)].sort().values for d in degree]
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(degree, 0)
    ids = torch.randint(0, 1000, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    return CsrLevel(indptr, torch.cat(codes).int(), ids, width)


def make_level(kind: str, gen: torch.Generator) -> DenseLevel | CsrLevel:
    return dense_level(gen) if kind == "dense" else csr_level(gen)


def width_of(level: DenseLevel | CsrLevel) -> int:
    return level.table.shape[1] if isinstance(level, DenseLevel) else level.width


def make_inputs(
    level: DenseLevel | CsrLevel, rows: int, noise: bool, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """nodes (nodes 0 and 1 included), parent scores (some -inf), quantized log-probs, noise."""
    num_nodes = (level.table if isinstance(level, DenseLevel) else level.indptr[1:]).shape[0]
    nodes = torch.randint(0, num_nodes, (rows,), generator=gen)
    nodes[:2] = torch.tensor([0, 1])
    parent = _quantized((rows,), gen, 0.5)
    parent[2] = NEG_INF  # a dead parent
    log_probs = _quantized((rows, K_CODES), gen, 0.25) - 3
    extra = _quantized((rows, width_of(level)), gen, 0.5) if noise else None
    return nodes, parent, log_probs, extra


def sorted_oracle(
    level: DenseLevel | CsrLevel, nodes, parent, log_probs, k: int, noise
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys built slot by slot, then torch's stable descending sort: (keys, positions) [R, k]."""
    width = width_of(level)
    keys = torch.full((nodes.shape[0], width), NEG_INF)
    for r, node in enumerate(nodes.tolist()):
        for j in range(width):
            if isinstance(level, DenseLevel):
                code = j if level.table[node, j] >= 0 else None
            else:
                edge = int(level.indptr[node]) + j
                code = int(level.codes[edge]) if edge < level.indptr[node + 1] else None
            if code is not None:
                keys[r, j] = parent[r] + log_probs[r, code]
    keys = keys if noise is None else keys + noise
    values, index = torch.sort(keys, dim=-1, descending=True, stable=True)
    return values[:, :k], index[:, :k]


def assert_same(got: TrieTopK, want: TrieTopK) -> None:
    for name, a, b in zip(TrieTopK._fields, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{a.shape} vs {b.dtype}"
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()}"


def test_stable_topk_equals_stable_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    x = _quantized((7, 300), gen, 0.5)
    x[0] = NEG_INF
    x[1, ::3] = -0.0  # equal to +0.0: must tie by index, as in torch.sort
    x[1, 1::3] = 0.0
    values, index = torch.sort(x, dim=-1, descending=True, stable=True)
    for k in (1, 17, 300):
        got_values, got_index = stable_topk(x, k)
        assert torch.equal(got_index, index[:, :k]) and torch.equal(got_values, values[:, :k])


def test_packed_keys_order_like_floats() -> None:
    x = torch.tensor([[NEG_INF, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")]])
    packed = pack_keys(x)
    # the high half orders like the floats (-0.0 ties with +0.0), the low half is 2^32-1 - index
    assert ((packed >> 32).diff() > 0).tolist() == [[True] * 3 + [False] + [True] * 3]
    assert (packed & 0xFFFFFFFF).tolist() == [[0xFFFFFFFF - j for j in range(8)]]


@pytest.mark.parametrize("kind", ["dense", "csr"])
@pytest.mark.parametrize("noise", [False, True])
def test_ref_equals_stable_sort(kind: str, noise: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    level = make_level(kind, gen)
    nodes, parent, log_probs, extra = make_inputs(level, 8, noise, gen)
    for k in (1, 6, width_of(level)):
        ref = trie_topk_ref(level, nodes, parent, log_probs, k, extra)
        keys, pos = sorted_oracle(level, nodes, parent, log_probs, k, extra)
        assert torch.equal(ref.pos, pos) and torch.equal(ref.key, keys)
        if not noise:
            assert ref.score is ref.key


@pytest.mark.parametrize("kind", ["dense", "csr"])
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("chunk", [None, 16])
def test_kernel_equals_ref(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, kind: str, noise: bool, chunk: int | None
) -> None:
    """Ties, dead parents, childless nodes, k above a row's valid children; one chunk or several
    (a small _MAX_CHUNK sends W = 37 through three chunks and their merges)."""
    if chunk is not None:
        monkeypatch.setattr(triton_trie_topk, "_MAX_CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    level = make_level(kind, gen)
    inputs = make_inputs(level, 6, noise, gen)
    level = type(level)(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in level))
    nodes, parent, log_probs, extra = (None if t is None else t.to(device) for t in inputs)
    for k in (1, 5, 16, width_of(level)):
        got = trie_topk(level, nodes, parent, log_probs, k, extra)
        assert_same(got, trie_topk_ref(level, nodes, parent, log_probs, k, extra))


def test_kernel_many_chunks_wide_rows(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W = 150 in chunks of 32 (four merges), k = 20 padded to 32, a non-contiguous log_probs."""
    monkeypatch.setattr(triton_trie_topk, "_MAX_CHUNK", 32)
    gen = torch.Generator().manual_seed(3)
    level = dense_level(gen, num_nodes=5, codes=150)
    nodes = torch.tensor([0, 1, 2, 3, 4, 1])
    parent = _quantized((6,), gen, 0.5)
    wide = _quantized((6, 160), gen, 0.25)
    log_probs = wide[:, 5:155]  # a column slice, as the "sid" normalization returns
    noise = torch.rand(6, 150, generator=gen)
    args = [t.to(device) for t in (nodes, parent, log_probs, noise)]
    level = DenseLevel(level.table.to(device))
    for extra in (None, args[3]):
        got = trie_topk(level, *args[:3], 20, extra)
        assert_same(got, trie_topk_ref(level, *args[:3], 20, extra))


def test_empty_rows_and_bad_arguments(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    level = DenseLevel(dense_level(gen).table.to(device))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    got = trie_topk(level, empty, empty.float(), torch.empty(0, K_CODES, device=device), 3)
    assert got.pos.shape == (0, 3)
    nodes = torch.zeros(2, dtype=torch.int64, device=device)
    parent, log_probs = torch.zeros(2, device=device), torch.zeros(2, K_CODES, device=device)
    with pytest.raises(ValueError, match="k must be in 1..W=37"):
        trie_topk(level, nodes, parent, log_probs, 38)
    with pytest.raises(ValueError, match="log_probs must be fp32"):
        trie_topk_ref(level, nodes, parent, log_probs.double(), 3)
    with pytest.raises(ValueError, match="dense table has 37 codes"):
        trie_topk_ref(level, nodes, parent, log_probs[:, :30], 3)
