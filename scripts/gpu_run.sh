#!/usr/bin/env bash
# One GPU session: install FlashInfer wheels + the project (offline), run the GPU test tier,
# then the benchmarks. Results land in $OUT (or ./bench_out). Usage on the GPU machine:
#   bash scripts/gpu_run.sh [tests|bench|ablations|all]   (run scripts/gpu_wheels.sh here first)
set -uo pipefail
what=${1:-all}
out=${OUT:-bench_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site MAX_JOBS=16 PYTHONUNBUFFERED=1
plugins=(); for p in flashrec_models_*/; do plugins+=(-e "./${p%/}"); done
python3 -m pip install -q --no-deps --no-build-isolation -e . "${plugins[@]}" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [[ $what == tests || $what == all ]]; then
  # NOTE: FlashInfer JIT-compiles each kernel variant on first use (10-30 s each): give this
  # stage several minutes on a fresh machine.
  python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels tests/core/test_trie.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
  for p in flashrec_models_*/; do
    python3 -m pytest -q -p no:cacheprovider "$p/tests" -k "fused_paths or gpu" 2>&1 | tail -3
  done
fi
if [[ $what == bench || $what == all ]]; then
  flashrec bench --preset qwen3-1.7b -n 50 --requests 400 --out "$out/bench_n50.json" --profile "$out/profile_n50.txt" 2>&1 | tail -25
  flashrec bench --preset qwen3-1.7b -n 512 --requests 64 --hf-requests 2 --hf-batch 1 --out "$out/bench_n512.json" 2>&1 | tail -25
fi
if [[ $what == ablations || $what == all ]]; then
  flashrec bench --preset qwen3-1.7b -n 50 --requests 320 --no-cascade --no-hf-baseline --out "$out/bench_n50_nocascade.json" 2>&1 | tail -16
  flashrec bench --preset qwen3-1.7b -n 50 --requests 320 --no-fp8 --no-hf-baseline --out "$out/bench_n50_bf16.json" 2>&1 | tail -16
  flashrec bench --preset qwen3-1.7b -n 512 --requests 32 --no-cascade --no-hf-baseline --out "$out/bench_n512_nocascade.json" 2>&1 | tail -16
fi
