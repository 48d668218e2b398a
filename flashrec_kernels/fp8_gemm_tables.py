"""Launch tables of the small-row FP8 GEMM, timed on a GPU: which tiles to launch at each row
count, and up to how many rows the kernel beats cuBLAS there. Pure Python (no triton import):
the engine reads `max_rows` when it builds a model's linears.

One JSON file per device name in `fp8_gemm_configs/` (`config_file`), written by
scripts/bench_gemm.py's sweep, as vLLM ships tuned configs of its Triton GEMMs per device:

    {"N=4096,K=2048": {"max_rows": 150,
                       "launches": {"50": {"block_m": 64, "block_n": 16, "block_k": 256,
                                           "num_warps": 4, "num_stages": 4}, ...}}, ...}

`max_rows`: the kernel was faster than `torch._scaled_mm` at every row count timed up to this
one (0: at none), so projections of that shape take it by default up to there
(EngineConfig.fp8_gemm_triton_rows = None).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CONFIG_DIR",
    "LaunchConfig",
    "ShapeTable",
    "TunedTable",
    "config_file",
    "faster_up_to",
    "tuned_table",
]

CONFIG_DIR = Path(__file__).parent / "fp8_gemm_configs"


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    """Programs per output tile, each over its share of K (`triton_fp8_gemm`); > 1 adds a
    second kernel that sums their fp32 partials."""


@dataclass(frozen=True)
class ShapeTable:
    """One weight shape's entry: the row count up to which the kernel is the faster GEMM, and
    the fastest launch at each row count timed, by rows."""

    max_rows: int
    launches: tuple[tuple[int, LaunchConfig], ...]


TunedTable = dict[tuple[int, int], ShapeTable]
"""(N, K) of a weight [N, K] -> its entry."""

_ENTRY = (
    '\'N=<out>,K=<in>\' -> {"max_rows": <rows>, "launches": {<rows>: {block_m, block_n, '
    "block_k[, num_warps, num_stages, split_k]}}}"
)


def config_file(device_name: str) -> Path:
    """The launch table of a GPU: its name with spaces as underscores, e.g.
    NVIDIA_H100_80GB_HBM3.json."""
    return CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"


@functools.cache
def tuned_table(path: Path) -> TunedTable:
    """The table in `path`; {} when there is none. A malformed file raises ValueError naming
    the file and the entry."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a JSON launch table ({exc}); rewrite it with "
                         "scripts/bench_gemm.py or delete it") from None  # fmt: skip
    table: TunedTable = {}
    for shape, entry in data.items():
        try:
            fields = dict(part.split("=") for part in shape.split(","))
            launches = sorted(
                (int(rows), LaunchConfig(**cfg)) for rows, cfg in entry["launches"].items()
            )
            max_rows = int(entry["max_rows"])
            if max_rows < 0:
                raise ValueError(f"max_rows {max_rows} < 0")
            if any(cfg.split_k < 1 for _, cfg in launches):
                raise ValueError("split_k < 1")
            table[(int(fields["N"]), int(fields["K"]))] = ShapeTable(max_rows, tuple(launches))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{path}: entry {shape!r} is not {_ENTRY} ({type(exc).__name__}: {exc})"
            ) from None
    return table


def faster_up_to(timings: list[tuple[int, float, float]]) -> int:
    """`max_rows` from a sweep: (rows, kernel us, cuBLAS us) per row count timed -> the largest
    row count up to which the kernel was faster at every count timed (0 if not at the smallest).
    A loss at some count ends it there: beyond a crossover cuBLAS keeps the larger inputs."""
    best = 0
    for rows, kernel_us, cublas_us in sorted(timings):
        if kernel_us >= cublas_us:
            break
        best = rows
    return best
