"""Beam-step attention alone, one layer: FlashInfer flat decode vs FlashInfer cascade vs the
Triton beam kernel (its default launch, and beside it the `VARIANTS`: the bf16 dots it had before
session 27, the 64-slot chunks it had before session 28, other pipeline depths), on the engine's own backends (plan once,
time `forward` with `triton.testing.do_bench`, which uses CUDA events).

Shape: Qwen3-1.7B attention (16 q / 8 kv heads, head_dim 128), FP8 or BF16 KV, 8,192 beam rows per
step (requests = 8192 // n), a level-2 step (2 own slots per beam); then the small waves of a
loaded server (`_small_waves`: n=50, 1-8 requests, every split count forced). With --defaults
only the Triton kernel's default launch is timed, and its output's max |diff| to FlashInfer's
cascade recorded: an A/B of two kernel trees (gpu_run.sh's KERNELS_BASE runs it on both; its
ATTENTION_VARIANTS names VARIANTS to time beside the default on this tree). Usage
(on the GPU):
    python scripts/bench_attention.py [OUT_DIR] [--kv bf16] [--defaults [--variants=NAME,...]]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton.testing

import flashrec_kernels.triton_beam_attention as tba
from flashrec_core.attention.flashinfer import FlashInferAttentionBackend
from flashrec_core.attention.triton_beam import TritonBeamAttention
from flashrec_core.engine.beam_wave import prepare_beam_decode
from flashrec_core.kvcache import KVPool
from flashrec_core.layers import ForwardBatch

HQ, HKV, D, ROWS, OWN = 16, 8, 128, 8192, 2
DEV = torch.device("cuda")


def _step(n: int, prompt: int, requests: int | None = None):
    reqs = requests or ROWS // n
    rows = reqs * n
    prompt_lens = torch.full((reqs,), prompt)
    prompts = torch.arange(1, 1 + reqs * prompt, device=DEV)
    first_own = 1 + reqs * prompt
    own_slots = torch.arange(first_own, first_own + rows * OWN, device=DEV).view(rows, OWN)
    row_request = torch.arange(reqs).repeat_interleave(n)
    return prepare_beam_decode(
        tokens=torch.zeros(rows, dtype=torch.int64, device=DEV),
        positions=torch.full((rows,), prompt + 1, device=DEV), prompts=prompts,
        prompt_lens=prompt_lens, row_request=row_request, history=own_slots[:, :-1],
        own=own_slots[:, -1],
    ), first_own + rows * OWN  # fmt: skip


# Other launches of the Triton beam kernel timed beside its default: name -> launcher arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16 dots": {"f16_dots": False},  # the operands before session 27
    "n64 s2": {"block_n": 64, "num_stages": 2},  # the unsplit launch before session 28
    "n128 s2": {"block_n": 128, "num_stages": 2},
    "n128 s3": {"block_n": 128, "num_stages": 3},  # the unsplit launch before session 36
    "n128 s4": {"block_n": 128, "num_stages": 4},
    # an experiment: the prompt's score dot on FP8 tensor cores, the queries rounded to e4m3 in
    # the kernel (FP8 caches only; its max |diff| to the default's output is in the JSON)
    "fp8 scores": {"fp8_scores": True},
    # 64-row tiles on 4 warps: without spills (session 41) 245 registers, so two programs fit an
    # SM's registers, and at 3-4 stages (82-99 KB) its shared memory: one program's softmax can
    # run while the other's dots do
    "m64 w4 s3": {"block_m": 64, "num_warps": 4, "block_n": 128, "num_stages": 3},
    "m64 w4 s4": {"block_m": 64, "num_warps": 4, "block_n": 128, "num_stages": 4},
}


@contextmanager
def _launch_with(**arguments: object) -> Iterator[None]:
    """The Triton beam kernel's launcher with `arguments` fixed, for the side-by-side columns
    (over the caller's own: the public wrapper passes num_splits=None)."""
    launch = tba.launch_beam_cascade_attention

    def forced(*args: object, **kwargs: object) -> None:
        launch(*args, **{**kwargs, **arguments})

    tba.launch_beam_cascade_attention = forced
    try:
        yield
    finally:
        tba.launch_beam_cascade_attention = launch


def _forward(backend, step, pool: KVPool, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One layer's attention of `step` through `backend`, planned once, as a call to time."""
    meta = backend.plan(step)
    batch = ForwardBatch(step.input_ids, step.positions, step.out_cache_loc, pool, backend, meta)
    return lambda: backend.forward(q, 0, D**-0.5, batch)


def _time(backend, step, pool: KVPool, q: torch.Tensor) -> float:
    return triton.testing.do_bench(_forward(backend, step, pool, q), warmup=25, rep=100)


def _time_in_graph(backend, step, pool: KVPool, q: torch.Tensor) -> float | None:
    """`_time` with the forward replayed from a CUDA graph, as a beam step's graph runs it (no
    Python launch cost, which at a few requests is as long as the kernels); None, said on
    stdout, if the forward cannot be captured."""
    forward = _forward(backend, step, pool, q)
    forward()  # compiled before the capture
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(forward, rep=100)
    except Exception as exc:  # a forward that cannot be captured: the caller times it eagerly
        print(f"  not timed in a graph ({type(exc).__name__}: {exc})", flush=True)
        return None


def _layer(kv_dtype: torch.dtype, n: int, prompt: int, requests: int | None = None):
    """One layer's inputs of a beam step (`_step`): the step, a pool of random KV over its
    slots, random queries."""
    step, slots = _step(n, prompt, requests)
    pool = KVPool(1, HKV, D, slots + 1, kv_dtype, DEV)
    pool.k_cache[0].copy_(torch.randn(pool.k_cache[0].shape, device=DEV).to(kv_dtype))
    pool.v_cache[0].copy_(torch.randn(pool.v_cache[0].shape, device=DEV).to(kv_dtype))
    q = torch.randn(step.input_ids.numel(), HQ, D, device=DEV, dtype=torch.bfloat16)
    return step, slots, pool, q


def _flashinfer(kv_dtype: torch.dtype, cascade: bool) -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend(
        DEV, cascade=cascade, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
        q_dtype=torch.bfloat16, kv_dtype=kv_dtype, max_rows=ROWS,
    )  # fmt: skip


def defaults_only(kv_dtype: torch.dtype, out: Path, variants: list[str]) -> None:
    """The Triton kernel's default launch at every shape of `main` and of `_small_waves`, each
    beside the max |diff| of its output to FlashInfer's cascade over the same KV (untimed): a
    kernel tree that computes something else shows it here, not only in its tests. `variants`
    (names of VARIANTS) are timed beside it at the 8,192-row shapes."""
    rows = []
    print(f"{'n':>5} {'prompt':>6} {'requests':>8} {'triton ms':>9} {'max |diff|':>10} "
          + "".join(f"{name:>10}" for name in variants))  # fmt: skip
    shapes = [(n, prompt, None) for n in (64, 256, 512) for prompt in (512, 1024, 2048)]
    for n, prompt, requests in shapes + [(50, 1024, r) for r in SMALL_WAVE_REQUESTS]:
        step, slots, pool, q = _layer(kv_dtype, n, prompt, requests)
        cascade = _flashinfer(kv_dtype, cascade=True)
        reference = _forward(cascade, step, pool, q)().float()
        beam = TritonBeamAttention(cascade, DEV, ROWS, slots + 1)
        diff = float((_forward(beam, step, pool, q)().float() - reference).abs().max())
        ms = _time(beam, step, pool, q)
        others = {}
        for name in variants if requests is None else ():
            with _launch_with(**VARIANTS[name]):
                others[name] = _time(beam, step, pool, q)
        reqs = requests or ROWS // n
        rows.append({"n": n, "prompt": prompt, "requests": reqs, "triton_ms": ms,
                     "max_abs_diff_to_cascade": diff,
                     **{f"triton_{k.replace(' ', '_')}_ms": v for k, v in others.items()}})  # fmt: skip
        print(f"{n:>5} {prompt:>6} {reqs:>8} {ms:>9.4f} {diff:>10.4f} "
              + "".join(f"{v:>10.4f}" for v in others.values()), flush=True)  # fmt: skip
        del pool
        torch.cuda.empty_cache()
    name = "bf16" if kv_dtype == torch.bfloat16 else "fp8"
    (out / f"bench_attention_defaults_{name}.json").write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows})
    )


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else Path(".")
    kv_dtype = torch.bfloat16 if "--kv" in sys.argv and "bf16" in sys.argv else torch.float8_e4m3fn
    if "--defaults" in sys.argv:
        named = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--variants=")), "")
        defaults_only(kv_dtype, out, [name for name in named.split(",") if name])
        return
    variants = {name: arguments for name, arguments in VARIANTS.items()
                if kv_dtype == torch.float8_e4m3fn or not arguments.get("fp8_scores")}  # fmt: skip
    results = []
    print(f"{'n':>5} {'prompt':>6} {'flat ms':>8} {'cascade ms':>10} {'triton ms':>9} "
          + "".join(f"{name:>10}" for name in variants)
          + f" {'flat/cascade':>12} {'cascade/triton':>14}")  # fmt: skip
    for n in (64, 256, 512):
        for prompt in (512, 1024, 2048):
            step, slots, pool, q = _layer(kv_dtype, n, prompt)
            flat = _time(_flashinfer(kv_dtype, cascade=False), step, pool, q)
            cascade_backend = _flashinfer(kv_dtype, cascade=True)
            cascade = _time(cascade_backend, step, pool, q)
            beam = TritonBeamAttention(cascade_backend, DEV, ROWS, slots + 1)
            tri = _time(beam, step, pool, q)
            others, diffs = {}, {}
            default_out = _forward(beam, step, pool, q)().float()
            for name, arguments in variants.items():
                with _launch_with(**arguments):
                    others[name] = _time(beam, step, pool, q)
                    if arguments.get("fp8_scores"):
                        got = _forward(beam, step, pool, q)().float()
                        diffs[f"triton_{name.replace(' ', '_')}_maxdiff"] = float(
                            (got - default_out).abs().max()
                        )
            row = {"n": n, "prompt": prompt, "requests": ROWS // n, "kv": str(kv_dtype),
                   "flat_ms": flat, "cascade_ms": cascade, "triton_ms": tri,
                   **{f"triton_{name.replace(' ', '_')}_ms": ms for name, ms in others.items()},
                   **diffs}  # fmt: skip
            results.append(row)
            print(f"{n:>5} {prompt:>6} {flat:>8.3f} {cascade:>10.3f} {tri:>9.3f} "
                  + "".join(f"{ms:>10.3f}" for ms in others.values())
                  + f" {flat / cascade:>12.2f} {cascade / tri:>14.2f}", flush=True)  # fmt: skip
            del pool
            torch.cuda.empty_cache()
    small = _small_waves(kv_dtype)
    name = "bench_attention_bf16.json" if kv_dtype == torch.bfloat16 else "bench_attention.json"
    (out / name).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results,
                                        "small_waves": small}))  # fmt: skip


SMALL_WAVE_REQUESTS = (1, 2, 4, 6, 8)
FORCED_SPLITS = (1, 2, 4, 8, 16)


def _small_waves(kv_dtype: torch.dtype) -> list[dict]:
    """The beam kernel at the beam steps of a server at 0.7x of saturation (session 31: a merged
    step of 100-400 rows, 0.6 ms of a 3.0 ms forward in the beam attention): n=50, 1-8 requests
    over 1,024-token prompts, the default launch (`auto_num_splits` keeps the grid within the
    SMs: 2 splits at 6 requests) beside every split count forced. A grid of about one program an
    SM, each walking its share of a prompt, is bound by that walk's latency, not by the few MB
    of KV it reads. Timed from CUDA graph replays where the forward captures (session 32's
    eager times, 34-49 us a layer, were half Python launches: 24 us a layer inside a step's
    graph), eagerly otherwise; `in_graph` in each row says which."""
    rows_out = []
    in_graph = True

    def timed(backend, step, pool: KVPool, q: torch.Tensor) -> float:
        nonlocal in_graph
        if in_graph:
            ms = _time_in_graph(backend, step, pool, q)
            if ms is not None:
                return ms
            in_graph = False
        return _time(backend, step, pool, q)

    print(
        f"{'requests':>8} {'default ms':>10} "
        + "".join(f"{f'{s} splits':>10}" for s in FORCED_SPLITS)
    )
    for requests in SMALL_WAVE_REQUESTS:
        step, slots, pool, q = _layer(kv_dtype, 50, 1024, requests)
        beam = TritonBeamAttention(_flashinfer(kv_dtype, cascade=True), DEV, ROWS, slots + 1)
        default = timed(beam, step, pool, q)
        forced = {}
        for splits in FORCED_SPLITS:
            with _launch_with(num_splits=splits):
                forced[splits] = timed(beam, step, pool, q)
        # timed again last, keeping the faster: session 32 read the default at 6 requests 1.8x
        # the same launch forced (2 splits) right after it, a first timing's outlier
        default = min(default, timed(beam, step, pool, q))
        rows_out.append({"n": 50, "prompt": 1024, "requests": requests, "default_ms": default,
                         "in_graph": in_graph,
                         **{f"splits_{k}_ms": ms for k, ms in forced.items()}})  # fmt: skip
        print(f"{requests:>8} {default:>10.4f} " + "".join(f"{ms:>10.4f}" for ms in forced.values()),
              flush=True)  # fmt: skip
        del pool
        torch.cuda.empty_cache()
    return rows_out


if __name__ == "__main__":
    main()
