"""The small-row FP8 GEMM (`flashrec_kernels.fp8_gemm`, in the interpreter) and its torch reference
against the exact product.

Bound, per output element: both sum e4m3 x e4m3 products (exact in fp32) in fp32, in different
orders, so each is within (K - 1) u * sum|products| of the exact sum (u = 2^-24, the classic
recursive-summation bound); the two scale multiplications and the bias add add at most 3 u of
the magnitudes involved; the final rounding to the output dtype adds at most half an ulp of it
(2^-9 relative for bf16, 2^-24 for fp32). The check uses one whole ulp (2^-8, 2^-23) for the last
term, a 2x margin; everything else is the derived bound. On a GPU the kernel's tensor cores sum
up to 128 products in Hopper's narrower fp8 accumulator before each fp32 promotion (~14 bits
kept, DeepSeek-V3 report 3.3.2; cuBLAS's precise FP8 GEMM does the same), so there the
summation term uses u = 2^-13 instead (the truncation unit of 14 bits)."""

from __future__ import annotations

import pytest
import torch

from flashrec_kernels import FP8_DTYPE, fp8_gemm, fp8_gemm_ref, quantize_rows_ref

U = 2.0**-24
OUT_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-23}


def operands(m: int, n: int, k: int, bias: bool, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = quantize_rows_ref(torch.randn(m, k, generator=gen) * 3)
    w, w_scale = quantize_rows_ref(torch.randn(n, k, generator=gen) * 0.05)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    out = (a, a_scale.squeeze(1), w, w_scale.squeeze(1), b)
    return tuple(t.to(device) if t is not None else None for t in out)


def assert_within_bound(y: torch.Tensor, a, a_scale, w, w_scale, b) -> None:
    u = 2.0**-13 if y.is_cuda else U  # the tensor cores' accumulator (module docstring)
    y, a, a_scale, w, w_scale = (t.cpu() for t in (y, a, a_scale, w, w_scale))
    b = b.cpu() if b is not None else None
    k = a.shape[1]
    terms = a.double().unsqueeze(1) * w.double().unsqueeze(0)  # [M, N, K], exact
    scale = a_scale.double().view(-1, 1) * w_scale.double().view(1, -1)
    bias = b.double().view(1, -1) if b is not None else torch.zeros(1, 1, dtype=torch.float64)
    exact = terms.sum(-1) * scale + bias
    magnitude = terms.abs().sum(-1) * scale + bias.abs()
    bound = OUT_ULP[y.dtype] * exact.abs() + (k - 1 + 3) * u * magnitude
    err = (y.double() - exact).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, (
        f"{y.dtype}: {int((err > bound).sum())} elements over the bound, worst by {worst}"
    )


@pytest.mark.parametrize(
    ("m", "n", "k", "bias"),
    [(1, 16, 64, False), (5, 48, 96, True), (50, 256, 256, False), (70, 40, 512, True)],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_kernel_and_reference_are_within_the_bound_of_the_exact_product(
    m: int, n: int, k: int, bias: bool, out_dtype: torch.dtype, device: torch.device
) -> None:
    """Shapes: one row; K not a multiple of the K step (96: the masked loop); a beam step of 50
    rows; 70 rows (two row tiles) with a bias."""
    a, a_scale, w, w_scale, b = operands(m, n, k, bias, device=device)
    for y in (
        fp8_gemm(a, a_scale, w, w_scale, b, out_dtype),
        fp8_gemm_ref(a, a_scale, w, w_scale, b, out_dtype),
    ):
        assert y.shape == (m, n) and y.dtype == out_dtype
        assert_within_bound(y, a, a_scale, w, w_scale, b)


def test_every_launch_configuration_computes_the_same_product(device: torch.device) -> None:
    """The bench's sweep (scripts/bench_gemm.py) may pick any tile sizes and K splits: each
    stays in bound, with masks on every edge (rows, columns and K not multiples of the tiles;
    a last split reaching past K). A split only changes the order of the fp32 sums, which the
    bound covers."""
    a, a_scale, w, w_scale, b = operands(37, 72, 160, True, seed=1, device=device)
    for launch in (
        dict(block_m=16, block_n=16, block_k=32),
        dict(block_m=64, block_n=64, block_k=64, num_warps=8),
        dict(block_m=32, block_n=128, block_k=256, num_stages=2),
        dict(block_m=16, block_n=16, block_k=32, split_k=4),  # 3 splits of 64: the last masked
        dict(block_m=64, block_n=32, block_k=32, split_k=5),  # 5 whole splits of 32
    ):
        assert_within_bound(
            fp8_gemm(a, a_scale, w, w_scale, b, **launch), a, a_scale, w, w_scale, b
        )


def test_a_k_split_sums_its_partials_in_a_second_kernel(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """split_k > 1 runs the K splits as programs of their own and sums their partials in a
    second launch (one program per 16 x 128 outputs); split_k = 1 launches one kernel; 0 is
    refused by name."""
    from flashrec_kernels import triton_fp8_gemm

    real, grids = triton_fp8_gemm._split_k_sum_kernel, []

    class Recorded:
        def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_fp8_gemm, "_split_k_sum_kernel", Recorded())
    a, a_scale, w, w_scale, b = operands(20, 200, 256, True, seed=2, device=device)
    y = fp8_gemm(a, a_scale, w, w_scale, b, block_m=16, block_n=16, block_k=64, split_k=2)
    assert grids == [(2, 2)]
    assert_within_bound(y, a, a_scale, w, w_scale, b)
    fp8_gemm(a, a_scale, w, w_scale, b, block_m=16, block_n=16, block_k=64)
    assert len(grids) == 1
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        fp8_gemm(a, a_scale, w, w_scale, b, split_k=0)


def test_zero_rows_return_an_empty_product(device: torch.device) -> None:
    a, a_scale, w, w_scale, _ = operands(1, 16, 64, False, device=device)
    y = fp8_gemm(a[:0], a_scale[:0], w, w_scale)
    assert y.shape == (0, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a, s, w, ws: (a.float(), s, w, ws), "must be torch.float8_e4m3fn"),
        (lambda a, s, w, ws: (a, s, w[:, :32].contiguous(), ws), "same K"),
        (lambda a, s, w, ws: (a, s[:1], w, ws), "a_scale must be float32 with one value per row"),
        (lambda a, s, w, ws: (a, s, w, ws.double()), "w_scale must be float32"),
        (lambda a, s, w, ws: (a.t().contiguous().t(), s, w, ws), "unit stride along K"),
    ],
)
def test_bad_operands_are_named(change, message: str, device: torch.device) -> None:
    a, a_scale, w, w_scale, _ = operands(4, 16, 64, False, device=device)
    args = change(a, a_scale, w, w_scale)
    for fn in (fp8_gemm, fp8_gemm_ref):
        with pytest.raises(ValueError, match=message):
            fn(*args)


def test_launch_config_gives_every_sm_a_program() -> None:
    """The bench preset's projections at a beam step of one n=50 request (132 SMs): at least one
    program per SM, rows in one tile, the widest column tile that allows it."""
    from flashrec_kernels.triton_fp8_gemm import launch_config

    for n, k, width in ((4096, 2048, 16), (2048, 2048, 16), (12288, 2048, 64), (2048, 6144, 16)):
        cfg = launch_config(50, n, k, sms=132)
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (64, width, 256), (n, k, cfg)
        assert -(-n // cfg.block_n) >= 132 or cfg.block_n == 16
    assert launch_config(1, 4096, 96).block_m == 16  # one row: the smallest row tile
    assert launch_config(1, 4096, 96).block_k == 128  # K below a step: its power of two


def test_the_reference_is_the_engine_cpu_path() -> None:
    """`fp8_linear` off CUDA (the CPU engine) scales before it multiplies, `fp8_gemm_ref` after:
    both are within the same bound of the exact product."""
    from flashrec_core.layers.quant import QuantizedActivation, fp8_linear

    a, a_scale, w, w_scale, b = operands(6, 32, 128, True)
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, b, torch.bfloat16)
    linear = fp8_linear(QuantizedActivation(a, a_scale.view(-1, 1)), w, w_scale, b, torch.bfloat16)
    assert_within_bound(linear, a, a_scale, w, w_scale, b)
    assert ref.dtype == linear.dtype == torch.bfloat16 and a.dtype == FP8_DTYPE


def test_a_launch_table_timed_on_a_gpu_overrides_the_heuristic(tmp_path) -> None:
    """scripts/bench_gemm.py's table (fp8_gemm_configs/<device>.json): the launch of the smallest
    timed row count >= m for that weight shape (the largest beyond them); shapes it lacks keep
    the heuristic; the file name is the device name with underscores."""
    import json

    from flashrec_kernels.fp8_gemm_tables import LaunchConfig, ShapeTable, config_file, tuned_table
    from flashrec_kernels.triton_fp8_gemm import launch_config

    path = tmp_path / "table.json"
    small = {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 5}
    wide = {"block_m": 64, "block_n": 64, "block_k": 256, "num_warps": 8, "num_stages": 3}
    entry = {"max_rows": 50, "launches": {"50": wide, "16": small}}
    path.write_text(json.dumps({"N=4096,K=2048": entry}))
    table = tuned_table(path)
    assert table == {
        (4096, 2048): ShapeTable(50, ((16, LaunchConfig(**small)), (50, LaunchConfig(**wide))))
    }
    assert launch_config(1, 4096, 2048, table=table) == LaunchConfig(**small)
    assert launch_config(17, 4096, 2048, table=table) == LaunchConfig(**wide)
    assert launch_config(500, 4096, 2048, table=table) == LaunchConfig(**wide)
    assert launch_config(50, 2048, 2048, table=table) == launch_config(50, 2048, 2048)
    assert tuned_table(tmp_path / "absent.json") == {}
    assert config_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_max_rows_ends_at_the_first_row_count_cublas_wins() -> None:
    from flashrec_kernels.fp8_gemm_tables import faster_up_to

    assert faster_up_to([(150, 9.0, 13.6), (16, 4.0, 13.0), (50, 5.0, 13.5)]) == 150
    assert faster_up_to([(16, 4.0, 13.0), (50, 14.0, 13.5), (150, 9.0, 13.6)]) == 16
    assert faster_up_to([(16, 13.0, 13.0)]) == 0 and faster_up_to([]) == 0


def test_no_table_off_cuda_means_cublas_everywhere() -> None:
    """`fp8_gemm_rows` (the engine's default row limit per projection): 0 without a GPU."""
    from flashrec_kernels import fp8_gemm_rows

    assert fp8_gemm_rows(4096, 2048, "cpu") == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not a JSON launch table"),
        ('{"4096x2048": {"max_rows": 0, "launches": {}}}', "entry '4096x2048' is not 'N=<out>"),
        ('{"N=4096,K=2048": {"max_rows": 0, "launches": {"50": {"block_m": 16}}}}', "TypeError"),
        ('{"N=4096,K=2048": {"max_rows": 0, "launches": {"fifty": {}}}}', "ValueError"),
        ('{"N=4096,K=2048": {"launches": {}}}', "KeyError: 'max_rows'"),
        ('{"N=4096,K=2048": {"max_rows": -1, "launches": {}}}', "max_rows -1 < 0"),
        (
            '{"N=4096,K=2048": {"max_rows": 0, "launches": {"50": {"block_m": 16, "block_n": 16, '
            '"block_k": 64, "split_k": 0}}}}',
            "split_k < 1",
        ),
    ],
)
def test_a_broken_launch_table_is_named(tmp_path, text: str, message: str) -> None:
    from flashrec_kernels.fp8_gemm_tables import tuned_table

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        tuned_table(path)
    assert str(path) in str(err.value)
