"""Item embeddings for semantic IDs: PPMI co-occurrence factorized by SVD, implicit matrix
factorization of the user-item matrix, or vectors the user brings as a .npy file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


class EmbeddingError(ValueError):
    """User-supplied embeddings do not match the log's items."""


def cooccurrence_embeddings(
    train: Mapping[str, Sequence[str]], items: Sequence[str], dim: int, window: int, seed: int
) -> np.ndarray:
    """SVD of the positive PMI of items that occur within `window` steps of each other
    (weight 1/distance, both directions) in the training sequences. [num_items, dim], float32."""
    from scipy import sparse

    index = {item: i for i, item in enumerate(items)}
    rows, cols, vals = [], [], []
    for seq in train.values():
        ids = np.array([index[i] for i in seq], dtype=np.int64)
        for dist in range(1, min(window, len(ids) - 1) + 1):
            rows += [ids[:-dist], ids[dist:]]
            cols += [ids[dist:], ids[:-dist]]
            vals += [np.full(2 * (len(ids) - dist), 1.0 / dist)]
    n = len(items)
    if not rows:
        return np.zeros((n, dim), dtype=np.float32)
    counts = sparse.coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n)
    ).tocsr()
    return _svd(_ppmi(counts), dim, seed)


def _ppmi(counts):
    """max(0, log(p(i, j) / (p(i) p(j)))) on the non-zeros of a sparse count matrix."""
    counts = counts.tocoo()
    total = counts.sum()
    marg = np.asarray(counts.sum(axis=1)).ravel()
    pmi = np.log(counts.data * total / (marg[counts.row] * marg[counts.col]))
    keep = pmi > 0
    from scipy import sparse

    return sparse.csr_matrix((pmi[keep], (counts.row[keep], counts.col[keep])), shape=counts.shape)


def matrix_factorization_embeddings(
    train: Mapping[str, Sequence[str]], items: Sequence[str], dim: int, seed: int
) -> np.ndarray:
    """Item factors of a truncated SVD of the binary user x item matrix (implicit MF)."""
    from scipy import sparse

    index = {item: i for i, item in enumerate(items)}
    pairs = {(u, index[i]) for u, seq in enumerate(train.values()) for i in seq}
    if not pairs:
        return np.zeros((len(items), dim), dtype=np.float32)
    u, i = np.array(sorted(pairs)).T
    matrix = sparse.csr_matrix((np.ones(len(u)), (u, i)), shape=(len(train), len(items)))
    return _svd(matrix.T.tocsr(), dim, seed)


def _svd(matrix, dim: int, seed: int) -> np.ndarray:
    """Rows of `matrix` projected on its top `dim` singular directions, scaled by sqrt(S)."""
    from sklearn.decomposition import TruncatedSVD

    k = max(1, min(dim, min(matrix.shape) - 1))
    svd = TruncatedSVD(n_components=k, algorithm="randomized", n_iter=10, random_state=seed)
    vectors = svd.fit_transform(matrix) / np.sqrt(np.maximum(svd.singular_values_, 1e-12))
    out = np.zeros((matrix.shape[0], dim), dtype=np.float32)
    out[:, :k] = vectors
    return out


def load_npy_embeddings(path: str | Path, ids_path: str | Path, items: Sequence[str]) -> np.ndarray:
    """Rows of a [num_vectors, dim] .npy file; line r of `ids_path` names row r's item."""
    path, ids_path = Path(path), Path(ids_path)
    for p, flag in ((path, "--embeddings"), (ids_path, "--embedding-ids")):
        if not p.is_file():
            raise EmbeddingError(f"{flag} file {p} does not exist")
    vectors = np.load(path, allow_pickle=False)
    ids = [line.strip() for line in ids_path.read_text(encoding="utf-8").splitlines()]
    ids = [i for i in ids if i]
    if vectors.ndim != 2 or vectors.shape[0] != len(ids):
        raise EmbeddingError(
            f"embeddings {path} have shape {vectors.shape} but {ids_path} names {len(ids)} items; "
            f"expected a 2-D array with one row per line of {ids_path}"
        )
    row = {item: r for r, item in enumerate(ids)}
    missing = [i for i in items if i not in row]
    if missing:
        raise EmbeddingError(
            f"embeddings {path}: {len(missing)} items of the log have no row in {ids_path}, "
            f"e.g. {missing[:5]}; add their vectors"
        )
    return np.asarray(vectors[[row[i] for i in items]], dtype=np.float32)
