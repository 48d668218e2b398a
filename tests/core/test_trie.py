from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashrec_core.search.trie import CsrTrie, DenseTrie, Trie, TrieError, build_trie


def random_catalog(seed: int, n: int, sizes: tuple[int, ...]) -> np.ndarray:
    """Unique SIDs in lexicographic order, like Catalog.codes."""
    rng = np.random.default_rng(seed)
    codes = np.stack([rng.integers(0, k, size=n) for k in sizes], axis=1)
    return np.unique(codes, axis=0)


def both(codes: np.ndarray, sizes: tuple[int, ...]) -> tuple[Trie, Trie]:
    return build_trie(codes, sizes, kind="dense"), build_trie(codes, sizes, kind="csr")


def edges(trie: Trie, level: int) -> list[list[tuple[int, int]]]:
    """Valid (code, child) pairs of every node at `level`."""
    nodes = torch.arange(trie.num_nodes(level))
    out = trie.children(level, nodes)
    return [
        [(c, x) for c, x, v in zip(cs, xs, vs, strict=True) if v]
        for cs, xs, vs in zip(
            out.codes.tolist(), out.child.tolist(), out.valid.tolist(), strict=True
        )
    ]


def walk(trie: Trie, sids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow each SID from the root: (catalog row or -1, level where it left the trie or -1)."""
    rows = sids.shape[0]
    node = torch.zeros(rows, dtype=torch.long)
    alive = torch.ones(rows, dtype=torch.bool)
    left_at = torch.full((rows,), -1, dtype=torch.long)
    for level in range(trie.depth):
        out = trie.children(level, node)
        hit = out.valid & (out.codes == torch.from_numpy(sids[:, level])[:, None])
        assert int(hit.sum(1).max()) <= 1, "a code appears once among a node's children"
        left_at[alive & ~hit.any(1)] = level
        alive &= hit.any(1)
        node = torch.where(alive, (out.child * hit).sum(1), 0)
    return torch.where(alive, trie.sid_index(node), -1), left_at


CATALOGS = {
    "random": (random_catalog(0, 150, (6, 9, 8)), (6, 9, 8)),
    "single_item": (np.array([[2, 0, 3]]), (4, 2, 5)),
    "chains": (np.array([[0, 0, 0], [1, 1, 1], [3, 2, 0]]), (4, 3, 2)),
    "full_first_level": (random_catalog(1, 500, (3, 40, 6)), (3, 40, 6)),
    "deep": (random_catalog(2, 200, (3, 3, 3, 3, 3)), (3, 3, 3, 3, 3)),
}


def test_node_numbering_on_a_small_catalog() -> None:
    codes = np.array([[0, 1], [0, 3], [2, 0]])
    dense, csr = both(codes, (3, 4))
    for trie in (dense, csr):
        assert [trie.num_nodes(d) for d in range(3)] == [1, 2, 3]
        assert edges(trie, 0) == [[(0, 0), (2, 1)]]
        assert edges(trie, 1) == [[(1, 0), (3, 1)], [(0, 2)]]
    assert [csr.max_children(d) for d in range(2)] == [2, 2]
    assert [dense.max_children(d) for d in range(2)] == [3, 4]


@pytest.mark.parametrize("name", list(CATALOGS))
def test_dense_and_csr_give_identical_children(name: str) -> None:
    codes, sizes = CATALOGS[name]
    dense, csr = both(codes, sizes)
    assert isinstance(dense, DenseTrie) and isinstance(csr, CsrTrie)
    for level in range(len(sizes)):
        assert dense.num_nodes(level) == csr.num_nodes(level)
        assert edges(dense, level) == edges(csr, level)
    assert dense.num_sids == csr.num_sids == len(codes)


def test_full_level_and_chain_widths() -> None:
    codes, sizes = CATALOGS["full_first_level"]
    assert build_trie(codes, sizes, kind="csr").max_children(0) == 3
    chains = build_trie(*CATALOGS["chains"], kind="csr")
    assert [chains.max_children(d) for d in range(3)] == [3, 1, 1]


@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_children_layout_and_padding(kind: str) -> None:
    codes, sizes = CATALOGS["random"]
    trie = build_trie(codes, sizes, kind=kind)
    for level in range(trie.depth):
        out = trie.children(level, torch.arange(trie.num_nodes(level)))
        width = trie.max_children(level)
        assert out.codes.shape == out.child.shape == out.valid.shape
        assert out.codes.shape == (trie.num_nodes(level), width)
        assert out.codes.dtype == out.child.dtype == torch.long and out.valid.dtype == torch.bool
        assert bool((out.child[~out.valid] == 0).all())
        if kind == "dense":
            assert torch.equal(out.codes[0], torch.arange(sizes[level]))
        else:
            assert bool((out.codes[~out.valid] == 0).all())
            n_valid = out.valid.sum(1, keepdim=True)
            assert torch.equal(out.valid, torch.arange(width) < n_valid)  # valid entries first
        for row in range(out.codes.shape[0]):
            present = out.codes[row][out.valid[row]]
            assert bool((present[1:] > present[:-1]).all()), "ascending codes"


@pytest.mark.parametrize("name", list(CATALOGS))
@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_walking_each_sid_reaches_its_row(name: str, kind: str) -> None:
    codes, sizes = CATALOGS[name]
    rows, left_at = walk(build_trie(codes, sizes, kind=kind), codes)
    assert rows.tolist() == list(range(len(codes)))
    assert bool((left_at == -1).all())


@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_non_catalog_sid_is_rejected_where_it_leaves(kind: str) -> None:
    codes, sizes = CATALOGS["random"]
    trie = build_trie(codes, sizes, kind=kind)
    rng = np.random.default_rng(7)
    probes = np.stack([rng.integers(0, k, size=2000) for k in sizes], axis=1)
    prefixes = [{tuple(row[:d]) for row in codes.tolist()} for d in range(len(sizes) + 1)]
    rows, left_at = walk(trie, probes)
    for probe, row, left in zip(probes.tolist(), rows.tolist(), left_at.tolist(), strict=True):
        if tuple(probe) in prefixes[-1]:
            assert codes[row].tolist() == probe and left == -1
        else:
            first_miss = next(
                d for d in range(1, len(sizes) + 1) if tuple(probe[:d]) not in prefixes[d]
            )
            assert (row, left) == (-1, first_miss - 1)
    assert int((rows == -1).sum()) > 1000  # the probes mostly miss
    assert set(left_at.tolist()) == {-1, 1, 2}


def test_rejection_at_the_first_level() -> None:
    codes, sizes = CATALOGS["chains"]  # first-level codes 0, 1, 3
    for trie in both(codes, sizes):
        rows, left_at = walk(trie, np.array([[2, 0, 0], [1, 0, 1], [1, 1, 0], [3, 2, 0]]))
        assert rows.tolist() == [-1, -1, -1, 2]
        assert left_at.tolist() == [0, 1, 2, -1]


def test_unsorted_input_keeps_its_row_numbers() -> None:
    codes = np.array([[2, 0], [0, 3], [0, 1]])
    for trie in both(codes, (3, 4)):
        assert walk(trie, codes)[0].tolist() == [0, 1, 2]
        assert edges(trie, 1) == [[(1, 2), (3, 1)], [(0, 0)]]


def test_auto_picks_by_dense_bytes() -> None:
    codes, sizes = CATALOGS["random"]
    num_nodes = [1, len(np.unique(codes[:, 0])), len(np.unique(codes[:, :2], axis=0))]
    dense_bytes = sum(n * k * 4 for n, k in zip(num_nodes, sizes, strict=True))
    assert isinstance(build_trie(codes, sizes, dense_max_bytes=dense_bytes), DenseTrie)
    assert isinstance(build_trie(codes, sizes, dense_max_bytes=dense_bytes - 1), CsrTrie)
    assert build_trie(codes, sizes, kind="dense").nbytes == dense_bytes


def test_build_errors() -> None:
    codes, sizes = CATALOGS["random"]
    with pytest.raises(TrieError, match=r"dense trie tables need .* use kind='csr'"):
        build_trie(codes, sizes, kind="dense", dense_max_bytes=100)
    with pytest.raises(TrieError, match="trie kind 'sparse' is unknown"):
        build_trie(codes, sizes, kind="sparse")  # type: ignore[arg-type]
    with pytest.raises(TrieError, match=r"SID \(1, 2, 3\) appears twice \(rows 0 and 2\)"):
        build_trie(np.array([[1, 2, 3], [0, 0, 0], [1, 2, 3]]), (4, 4, 4))
    with pytest.raises(TrieError, match=r"SID row 1 has code 4 at level 2, expected 0..3"):
        build_trie(np.array([[1, 2, 3], [0, 0, 4]]), (4, 4, 4))
    with pytest.raises(TrieError, match=r"depth = 2 .*got shape \(1, 3\)"):
        build_trie(np.array([[1, 2, 3]]), (4, 4))
    with pytest.raises(TrieError, match="non-empty"):
        build_trie(np.zeros((0, 2), dtype=np.int64), (4, 4))


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique_dim"}


@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_children_is_capture_safe(kind: str) -> None:
    codes, sizes = CATALOGS["random"]
    trie = build_trie(codes, sizes, kind=kind)
    level = 1
    shapes = set()
    for seed in range(3):
        nodes = torch.randint(
            0, trie.num_nodes(level), (16,), generator=torch.Generator().manual_seed(seed)
        )
        with OpRecorder() as rec:
            out = trie.children(level, nodes)
        assert not rec.ops & HOST_SYNC_OPS, f"host-syncing ops {rec.ops & HOST_SYNC_OPS}"
        shapes.add(tuple(tuple(t.shape) for t in out))
    assert shapes == {((16, trie.max_children(level)),) * 3}


@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_to_keeps_kind_and_results(kind: str) -> None:
    codes, sizes = CATALOGS["random"]
    trie = build_trie(codes, sizes, kind=kind)
    moved = trie.to("cpu")
    assert type(moved) is type(trie)
    nodes = torch.arange(trie.num_nodes(2))
    assert all(
        torch.equal(a, b)
        for a, b in zip(trie.children(2, nodes), moved.children(2, nodes), strict=True)
    )
    assert torch.equal(trie.sid_index(nodes), nodes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "csr"])
def test_children_replays_in_cuda_graph(kind: str) -> None:
    codes, sizes = CATALOGS["random"]
    trie = build_trie(codes, sizes, kind=kind).to("cuda")
    nodes = torch.zeros(32, dtype=torch.long, device="cuda")
    trie.children(1, nodes)  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = trie.children(1, nodes)
    new_nodes = torch.randint(0, trie.num_nodes(1), (32,), device="cuda")
    nodes.copy_(new_nodes)
    graph.replay()
    eager = trie.children(1, new_nodes)
    assert all(torch.equal(a, b) for a, b in zip(static, eager, strict=True))


@pytest.mark.slow
def test_million_sid_catalog_builds_csr_in_seconds() -> None:
    sizes = (8192, 8192, 8192)
    rng = np.random.default_rng(0)
    packed = np.unique(rng.integers(0, 8192**3, size=1_000_000, dtype=np.int64))
    codes = np.stack([packed // 8192**2, packed // 8192 % 8192, packed % 8192], axis=1)
    start = time.perf_counter()
    trie = build_trie(codes, sizes)
    elapsed = time.perf_counter() - start
    assert isinstance(trie, CsrTrie)
    assert trie.num_sids == len(codes) and trie.nbytes < 64 << 20
    sample = rng.choice(len(codes), size=2000, replace=False)
    assert walk(trie, codes[sample])[0].tolist() == sample.tolist()
    assert elapsed < 20, f"building the 1M-SID trie took {elapsed:.1f} s"
    print(f"1M-SID CSR trie built in {elapsed:.2f} s, {trie.nbytes / 2**20:.1f} MiB")
