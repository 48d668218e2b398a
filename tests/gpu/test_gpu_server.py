"""`flashrec serve` on CUDA in both modes: the engine in a process of its own (the default: a
spawned child that opens the device, captures its CUDA graphs and warms its catalog there) and
in the server's process (`--no-engine-process`), on one GPU checkpoint. One request at a time,
each mode runs the same kernels on the same shapes, so the answers must agree: the same ranked
SIDs and items, log-probs to `ATOL_SAME_KERNELS`. Filtered requests included: their filters
cross the pipe as SID bits, from which the engine process builds a search-only filter."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint
from flashrec_core.testing.hf_beam import assert_same_ranking
from flashrec_core.testing.server_process import ServerProcess, read_metrics

pytestmark = pytest.mark.gpu

ATOL_SAME_KERNELS = 1e-5
"""Two servers, one request alone in each: the same kernels on the same shapes (graph replay or
eager alike in both), so the same sums in the same order. 1e-5 only absorbs printing; a wrong
filter, catalog or beam moves a log-prob by far more (the gap between distinct beams)."""


def serve_args(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--model-path", str(checkpoint), "--catalog", str(checkpoint / "catalog.json"),
        "--device", "cuda", "--kv-cache-tokens", "16384", "--warmup-n", "8", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPU tier's tiny Qwen3 (head_dim 64, which FlashInfer compiles for)."""
    path = tmp_path_factory.mktemp("serve-gpu")
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    write_catalog(path / "catalog.json", random_codes(400, seed=3))
    return path


@pytest.fixture(scope="module")
def servers(checkpoint: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with (
        ServerProcess(serve_args(checkpoint), ready_timeout_s=600) as default,
        ServerProcess(serve_args(checkpoint, "--no-engine-process"), ready_timeout_s=600) as one,
    ):
        yield default, one


def _ranked(body: dict) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(c["flashrec"]["codes"]), c["flashrec"]["logprob"]) for c in body["choices"]]


def _items(body: dict) -> set[str]:
    return {item for c in body["choices"] for item in c["flashrec"]["items"]}


def _ask(server: ServerProcess, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_both_modes_answer_alike_filtered_or_not(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    default, one = servers
    assert default.engine_pid() in default.children()
    with pytest.raises(AssertionError, match="no engine process"):
        one.engine_pid()
    rng = random.Random(7)
    items = [f"item-{i}" for i in range(400)]
    for n in (1, 8, 50):
        prompt = [rng.randrange(5, 60) for _ in range(rng.randrange(4, 40))]
        plain = {"prompt": prompt, "n": n}
        a, b = _ask(default, plain), _ask(one, plain)
        assert_same_ranking(_ranked(a), _ranked(b), ATOL_SAME_KERNELS, ATOL_SAME_KERNELS)
        assert [c["flashrec"]["items"] for c in a["choices"]] == [
            c["flashrec"]["items"] for c in b["choices"]
        ]
        excluded = sorted(_items(a))[: max(1, n // 2)]  # some of the unfiltered answer
        allowed = rng.sample(items, 120)
        for extra in ({"exclude_items": excluded}, {"allow_items": allowed}):
            body = {**plain, **extra}
            fa, fb = _ask(default, body), _ask(one, body)
            assert_same_ranking(_ranked(fa), _ranked(fb), ATOL_SAME_KERNELS, ATOL_SAME_KERNELS)
            assert len(fa["choices"]) == n
            if "exclude_items" in extra:
                assert not _items(fa) & set(excluded), "an excluded item came back"
            else:
                assert _items(fa) <= set(allowed), "an item outside allow_items came back"
    for server in servers:
        metrics = read_metrics(server.url)
        assert metrics["flashrec_invalid_results_total"] == 0
        assert metrics["flashrec_engine_own_process"] == (server is default)
