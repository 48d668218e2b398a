#!/usr/bin/env bash
# One GPU session: install FlashInfer wheels + the project (offline), then run the named stages
# in order. Results land in $OUT (or ./bench_out). Usage on the GPU machine:
#   bash scripts/gpu_run.sh STAGE...     (run scripts/gpu_wheels.sh here first)
# Stages: tests (GPU test tier), bench (n=50 with profile, n=512), ablations (FlashInfer cascade,
# flat decode, BF16, graphs off), bench50 / bench512 (one width), triton (beam steps forced through the Triton kernel),
# gputests (tests/gpu + the beam kernels and the small-row FP8 GEMM only), prefillgraphs (the prefill graph tests of tests/gpu/test_cuda_graphs.py), kernels (tests/kernels natively), beamkernel (the Triton beam kernel's tests alone), fresh (the GPU tests of --prefill-attention fresh), e2e / e2e-engine / e2e-server (Engine.generate + flashrec serve under load; E2E_N="50:400 512:64" picks the engine widths), server-ab (the server with and without --admission-delay-factor 1), contract (contract v2: plugins' GPU tier + kernels), filters (item-filter cost at n=512), diagnose (scripts/diagnose_gpu_search.py), request-profile (scripts/profile_request.py: one unloaded request under torch.profiler and cProfile), prefillattn (the Triton prefill kernel's tests natively, then scripts/bench_prefill_attention.py), prefillab (request-profile and Engine.generate with the Triton prefill kernel, then with FlashInfer's), freshab (the same with the Triton prefill kernel, then --prefill-attention fresh, auto's choice on sm90), prefillacc (scripts/diagnose_prefill_accuracy.py: beam scores vs fp32 transformers with either prefill, every architecture), thread-probe (scripts/engine_thread_probe.py: the engine loop offline, on its thread, under closed loops, beside a GIL burner; PROBE_N="50:400"), syncs (scripts/find_syncs.py), server-profile (cProfile of the engine thread under load), attention (scripts/bench_attention.py), elementwise (scripts/bench_elementwise.py: SiLU-mul and RMSNorm launch configurations against the copy bandwidth), gemm (scripts/bench_gemm.py: the FP8 projections by row count against the GEMM peak; GEMM_GRAPHS=1 in graph replays), gemm-table (this tree's kernels with the gemm stage's table, in /tmp/gemm_table, for E2E_AB), streams (scripts/bench_stream_priority.py: would a high-priority stream stop beam steps waiting behind prefills), compare (the published reference engine, PyPI flashrec 0.1.2 from .whl/ref/, and ours on one checkpoint: scripts/compare_reference.py; COMPARE_ARGS adds its flags, e.g. "--widths 50 --requests 400"). Each stage runs under its own time guard (STAGE_S seconds,
# default 420) so that a slow stage still leaves the logs of the others in $OUT. CALL_S (default 550)
# bounds the whole script below the device tool's 600 s per-call limit: a stage never runs past it,
# so the compiled kernels are always packed on exit (a call killed from outside packs nothing).
# PYTEST_WORKERS (default 4) runs the pytest stages under pytest-xdist: FlashInfer JIT-compiles
# different kernel variants in different workers at once (it locks per variant).
set -uo pipefail
# What comes back from the device tool is at most 8 files: the script's output goes to
# $OUT/run.log as it is printed (so a call killed from outside still returns it), every stage's
# files to a work folder packed into $OUT/results.tgz on exit, the compiled kernels to
# $OUT/ficache.txz.* and $OUT/triton.txz.*.
final=${OUT:-bench_out}
out=/tmp/gpu_results
mkdir -p "$final" "$out"
exec > >(tee -a "$final/run.log") 2>&1
guard=${STAGE_S:-420}
deadline=$(( $(date +%s) + ${CALL_S:-550} ))
# seconds the next command may run: its stage guard, cut to what is left before the deadline
left() { local rest=$(( deadline - $(date +%s) )); (( rest < guard )) && echo $(( rest > 1 ? rest : 1 )) || echo "$guard"; }
# seconds before the deadline; every wait in this script is bounded by it, so the script always
# ends (and packs) on its own before the call's limit
remaining() { echo $(( deadline - $(date +%s) )); }
timeout 180 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site MAX_JOBS=16 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
# FlashInfer JIT-compiles each kernel variant on first use (10-60 s each) into a cache that dies
# with the machine. The .so files of a previous run (.ficache/, brought with `carry`) are
# restored as FlashInfer's AOT kernels, which it loads without compiling; new ones are packed
# into $OUT/ficache.txz.* at the end for the next run.
aot=/tmp/site/flashinfer/data/aot
# xz, not gzip: the .so files pack to half the size, and carry is capped at 64 MiB.
if compgen -G ".ficache/ficache.txz.*" >/dev/null; then
  mkdir -p "$aot" && cat .ficache/ficache.txz.* | tar xJf - -C "$aot" && echo "restored $(ls "$aot" | wc -l) FlashInfer kernels"
fi
# Triton's compiled kernels likewise (the beam kernel and the fused elementwise kernels compile per
# shape specialization): restored from .ficache/triton.txz.*, packed into $OUT/triton.txz.* on exit.
export TRITON_CACHE_DIR=/tmp/tritoncache
# the cubins and their metadata only: the IR and PTX beside them were 85% of the packed cache
# (session 44: 21.6 MB packed against 3.0 without them), and carry is capped at 64 MiB;
# flashrec_kernels.gpu_compile compiles anew where it reads PTX
export TRITON_STORE_BINARY_ONLY=1
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".ficache/triton.txz.*" >/dev/null; then
  cat .ficache/triton.txz.* | tar xJf - -C "$TRITON_CACHE_DIR" && echo "restored $(ls "$TRITON_CACHE_DIR" | wc -l) Triton kernels"
fi
pack_kernels() {
  [[ -n $(ls "$TRITON_CACHE_DIR") ]] && tar cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 15m - "$final/triton.txz."
  local tmp; tmp=$(mktemp -d)
  find /tmp/fiws -name '*.so' -path '*cached_ops*' | while read -r f; do
    d="$tmp/$(basename "$(dirname "$f")")"; mkdir -p "$d"; cp "$f" "$d/"; done
  [[ -d $aot ]] && cp -r --update=none "$aot"/. "$tmp"/
  [[ -n $(ls "$tmp") ]] && tar cf - -C "$tmp" . | xz -T0 -6 | split -b 15m - "$final/ficache.txz."
}
finish() {
  pack_kernels
  # profiler traces (PROFILE_S) apart: a GPU window under load can exceed the 16 MiB a file may
  # bring back, which would lose results.tgz with it; the summaries stay in the bench JSON
  local traces; traces=$(cd "$out" && find . -name '*.trace.json.gz')
  if [[ -n $traces ]]; then
    # shellcheck disable=SC2086  # a list of paths (names the engine chose: no spaces)
    (cd "$out" && tar cf "$final/traces.tar" $traces && rm -f $traces)
    (( $(stat -c %s "$final/traces.tar") < 16000000 )) || { rm -f "$final/traces.tar"; echo "traces over 16 MB: not brought back"; }
  fi
  tar czf "$final/results.tgz" -C "$out" .
  ls -la "$final"
}
trap finish EXIT
plugins=(); for p in flashrec_models_*/; do plugins+=(-e "./${p%/}"); done
timeout 300 python3 -m pip install -q --no-deps --no-build-isolation -e . "${plugins[@]}" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
bench() { timeout "$(left)" flashrec bench --preset qwen3-1.7b "$@"; }
workers=${PYTEST_WORKERS:-4}
# pytest_gpu LOG ARGS...: the GPU tier under xdist, each worker with its share of the CPU cores
# (the tests' CPU references and transformers oracles would otherwise oversubscribe them)
pytest_gpu() {
  local log=$1; shift
  OMP_NUM_THREADS=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 )) FLASHREC_INSTANT_FAILURES=1 \
    timeout "$(left)" python3 -m pytest -q -n "$workers" -rfE --tb=short -p no:cacheprovider "$@" \
    2>&1 | tee "$log" | tail -40
}
ck=/tmp/bench-ckpt  # the bench preset as a real checkpoint directory (e2e, filters, syncs, compare)
ensure_checkpoint() {
  [[ -f $ck/config.json ]] || timeout "$(left)" flashrec bench --preset qwen3-1.7b --write-checkpoint "$ck" 2>&1 | tail -2
}
# request_ab N:REQUESTS NAME FLAGS_A FLAGS_B TAG_B: one unloaded request's profile at both widths
# (scripts/profile_request.py), then Engine.generate at width N (flashrec bench --engine), with
# the engine flags A, then B (B's files carry TAG_B)
request_ab() {
  local spec=$1 name=$2 tag flags
  ensure_checkpoint
  for tag in "" "$5"; do
    if [[ -z $tag ]]; then flags=$3; else flags=$4; fi
    # shellcheck disable=SC2086  # $flags is a list of flags
    timeout "$(left)" python3 scripts/profile_request.py "$ck" "$out" --repeats 10 --tag "$tag" $flags \
      2>&1 | grep -E "^(## n=|wall|GPU|per request)"
    # shellcheck disable=SC2086
    timeout "$(left)" flashrec bench --engine "$ck" -n "${spec%:*}" --requests "${spec#*:}" $flags \
      --out "$out/${name}_n${spec%:*}$tag.json" 2>&1 | tail -22
  done
  gzip -f "$out"/trace_request_*.json
}
# wait_ready PORT: until the server there answers /ready (true) or the deadline is 10 s away
wait_ready() {
  while (( $(remaining) > 10 )); do
    curl -sf "localhost:$1/ready" >/dev/null && return 0
    sleep 0.5
  done
  echo "the server on port $1 was not ready before the call's deadline"; return 1
}
# stop_server PID: SIGTERM (the server drains), then SIGKILL once 30 s or the deadline passed
stop_server() {
  kill -TERM "$1"
  local end=$(( $(date +%s) + 30 ))
  while kill -0 "$1" 2>/dev/null && (( $(date +%s) < end && $(remaining) > 3 )); do sleep 0.5; done
  kill -0 "$1" 2>/dev/null && { echo "server $1 still running: killed"; kill -KILL "$1"; }
  wait "$1"; echo "serve exit $?"
}
# engine_bench N:REQUESTS TAG [NAME=VALUE...] [BENCH FLAGS...]: Engine.generate on the bench
# checkpoint (flashrec bench --engine) with that environment and those flags, written to
# $out/e2e_engine_nN$TAG.json
engine_bench() {
  local spec=$1 tag=$2; shift 2
  local envs=()
  while [[ ${1:-} =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("$1"); shift; done
  echo "--- Engine.generate n=${spec%:*} (${envs[*]} $*)"
  env "${envs[@]}" timeout "$(left)" flashrec bench --engine "$ck" -n "${spec%:*}" \
    --requests "${spec#*:}" "$@" --out "$out/e2e_engine_n${spec%:*}$tag.json" > "$out/e2e_engine_n${spec%:*}$tag.log" 2>&1
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(
    "{requests} requests: {requests_per_s:.1f} req/s, {percent_of_roofline:.1f}% of floor "
    "({roofline_requests_per_s:.1f} req/s: {peak_gemm_tflops:.0f} TFLOP/s, {peak_copy_tb_per_s:.2f} TB/s), p50 "
    "{latency_p50_ms:.0f} ms; unloaded p50 {single_request_p50_ms:.2f} ms; peak {peak_memory_gib:.1f} "
    "GiB (KV pool {kv_pool_gib:.1f}); waiting for results {results_wait_share:.0%} of the call; "
    "invalid {invalid_results}; graph replays {graph_replays}, eager steps {eager_steps}; "
    "prefills through {prefill_attention} {fresh_prefill_paths}".format(**d))' \
    "$out/e2e_engine_n${spec%:*}$tag.json" 2>/dev/null || tail -5 "$out/e2e_engine_n${spec%:*}$tag.log"
  # with --trace-dir among the flags: the traced call's loop summary (bench/trace_summary.py)
  grep -A14 "^profile window" "$out/e2e_engine_n${spec%:*}$tag.log" | grep -vE "^  +[0-9.]+  "
}
# serve_bench TAG [SERVE FLAGS...]: flashrec serve on the bench checkpoint, then the server bench at
# the SERVER_SPECS phases; each is printed as it ends and written to $out/e2e_server_nN_cC$TAG.json
serve_bench() {
  local tag=$1 srv n reqs; shift
  # leading NAME=VALUE words are the server's environment (e.g. OMP_NUM_THREADS=1), the rest flags
  local envs=()
  while [[ ${1:-} =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("$1"); shift; done
  # PROFILE_S (the script's, or a PROFILE_S=S word of this variant): a torch.profiler window of
  # S seconds in each open-loop rate (serve --torch-profile-dir, bench --profile-seconds; traces
  # in $out/traces$TAG). The window slows the run it watches: profile a variant of its own.
  local PROFILE_S=${PROFILE_S:-} e
  for e in "${envs[@]}"; do [[ $e == PROFILE_S=* ]] && PROFILE_S=${e#PROFILE_S=}; done
  env "${envs[@]}" flashrec serve -v --model-path "$ck" --catalog "$ck/catalog.json" \
    --warmup-n 50,512 --port 8123 "$@" \
    ${PROFILE_ENGINE:+--profile-engine "$out/engine_profile$tag.txt"} \
    ${PROFILE_S:+--torch-profile-dir "$out/traces$tag"} > "$out/serve$tag.log" 2>&1 &
  srv=$!
  wait_ready 8123 || { stop_server $srv; tail -5 "$out/serve$tag.log"; return; }
  echo "ready after warm-up: $(grep -c captured "$out/serve$tag.log") captures (serve flags: ${envs[*]} $*)"
  grep -o "device memory: .*" "$out/serve$tag.log" | head -1
  grep -o -E "engine thread: .*|small-row FP8 GEMM: .*" "$out/serve$tag.log" | sort -u
  # each phase sends 4x the concurrency, so the closed loop measures a steady state, not one
  # burst (at n=50, 3x once gave 84% of Engine.generate where 4x on the same machine gave 94%,
  # session 42), and each open-loop rate runs long enough for a p99
  # SERVER_SPECS: N:REQUESTS:CONCURRENCY per phase; SERVER_RATES: the open-loop rates (fractions
  # of the closed loop's throughput). Saturation means full waves: 800 n=50 requests in flight
  # keep ~160-request waves (8,192 beam rows) admitted as Engine.generate's are; 400 left them at
  # 100 (session 22)
  for spec in ${SERVER_SPECS:-50:3200:800 512:256:64}; do
    IFS=: read -r n reqs conc <<< "$spec"
    local log="$out/bench_server_n${n}_c$conc$tag.log"
    timeout "$(left)" flashrec bench --server http://127.0.0.1:8123 --model-dir "$ck" -n "$n" \
      --requests "$reqs" --concurrency "$conc" --rates "${SERVER_RATES:-0.5,0.7,0.9,1.1}" \
      ${PROFILE_S:+--profile-seconds "$PROFILE_S"} \
      --out "$out/e2e_server_n${n}_c$conc$tag.json" 2>"$log" >/dev/null
    # each phase's line, and with PROFILE_S each open-loop rate's profiler window summary
    grep -E -A14 "^(n=|profile window)" "$log" | grep -vE "^  +[0-9.]+  " \
      || { echo "no phase finished; the bench's last lines:"; tail -5 "$log"; }
  done
  curl -s localhost:8123/metrics | grep -E "^flashrec_(invalid|kv_slots|running|queue|requests_total|engine_beam)"
  # CPU seconds of each of the server's threads (utime + stime in clock ticks), busiest first:
  # which threads the "server CPU outside the engine thread" of the bench lines went to (the
  # engine process's threads too, by default: the server's child processes)
  for p in $srv $(pgrep -P "$srv"); do
    for t in /proc/$p/task/*; do
      echo "$(awk '{print $14 + $15}' "$t/stat") ticks  pid $p tid ${t##*/}  $(cat "$t/comm")"
    done
  done 2>/dev/null | sort -rn | head -25 > "$out/threads$tag.txt"
  head -8 "$out/threads$tag.txt"
  stop_server $srv; tail -3 "$out/serve$tag.log"
}

# on_base_kernels SCRIPT ARGS...: a bench script on KERNELS_BASE's flashrec_kernels (first on
# PYTHONPATH) instead of this tree's, writing into $out/base: the base half of an A/B
on_base_kernels() {
  local script=$1; shift
  mkdir -p "$out/base"
  echo "--- base kernels ($KERNELS_BASE): $script $*"
  PYTHONPATH="$PWD/$KERNELS_BASE:$PYTHONPATH" timeout "$(left)" python3 "$script" "$out/base" "$@"
}

for what in "${@:-tests}"; do
  (( $(remaining) > 15 )) || { echo "=== stage $what skipped: the call's deadline is near"; continue; }
  echo "=== stage $what ($(date +%T))"
  case $what in
    gputests)
      pytest_gpu "$out/gpu_tests.log" tests/gpu tests/kernels/test_trie_topk.py tests/kernels/test_beam_attention.py \
        tests/kernels/test_fp8_gemm.py ;;
    prefillgraphs)  # the prefill graph tests alone (replay == eager, chunked prefills); GRAPH_K
      # replaces the -k expression (e.g. "split": every graph test on the no-split-KV engine)
      pytest_gpu "$out/graph_tests.log" tests/gpu/test_cuda_graphs.py -k "${GRAPH_K:-prefill}" ;;
    kernels)  # every kernel test natively (tests/kernels: the launch configurations included);
      # KERNEL_TESTS narrows it to some files
      # shellcheck disable=SC2086  # a list of paths
      pytest_gpu "$out/kernel_tests.log" ${KERNEL_TESTS:-tests/kernels} ;;
    fresh)  # --prefill-attention fresh natively: prefill graphs replay == eager, chunked
      # prefills, beam scores against fp32 transformers (every architecture, BF16 and FP8), and
      # the RoPE kernel (its mirror writes the own rows into the fresh buffers) and the context copy
      pytest_gpu "$out/fresh_tests.log" tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_engine.py \
        tests/kernels/test_rope_norm_store.py tests/kernels/test_copy_kv_rows.py \
        -k "fresh or mirror or kv_rows or rope_norm_store" ;;
    beamkernel)  # the Triton beam kernel natively against its reference (split-KV included)
      pytest_gpu "$out/beam_kernel_tests.log" tests/kernels/test_beam_attention.py ;;
    tests)  # the whole GPU tier: tests/gpu, every kernel natively, each plugin's GPU/fused tests
      pytest_gpu "$out/gpu_tests.log" tests/gpu tests/kernels flashrec_models_*/tests -k "gpu or GPU or kernels or fused" ;;
    contract)  # model contract v2 on the device: every plugin's GPU conformance tier (FlashInfer
      # soft-cap / sliding window, Triton beam kernel soft-cap, graphs, BF16 + FP8), the kernels.
      # Part 1 is the contract's proof (Gemma, Gemma 2, the soft-cap kernels, every backend
      # honouring a layer's spec), so a cut run still reports it; part 2 is everything else.
      pytest_gpu "$out/contract_tests.log" flashrec_models_gemma/tests tests/kernels/test_beam_attention.py \
        tests/kernels/test_gelu_mul_fp8.py tests/gpu/test_flashinfer_attention.py \
        -k "gpu or GPU or kernel or fused or softcap"
      pytest_gpu "$out/contract_tests_2.log" flashrec_models_llama/tests flashrec_models_phi/tests \
        flashrec_models_qwen3/tests tests/gpu --deselect tests/gpu/test_flashinfer_attention.py \
        -k "gpu or GPU or kernel or fused" ;;
    bench50)
      bench -n 50 --requests 400 --out "$out/bench_n50.json" --profile "$out/profile_n50.txt" 2>&1 | tail -25 ;;
    triton)  # explicitly through the Triton beam kernel (the default where it applies), both widths
      bench -n 50 --requests 400 --beam-attention triton --no-hf-baseline --out "$out/bench_n50_triton.json" 2>&1 | tail -16
      bench -n 512 --requests 64 --beam-attention triton --no-hf-baseline --out "$out/bench_n512_triton.json" 2>&1 | tail -16 ;;
    synthetic)  # the synthetic wave path at both widths, no HF baseline (side by side with e2e)
      bench -n 50 --requests 400 --no-hf-baseline --out "$out/bench_n50.json" 2>&1 | tail -20
      bench -n 512 --requests 64 --no-hf-baseline --out "$out/bench_n512.json" 2>&1 | tail -20 ;;
    bench512)
      bench -n 512 --requests 64 --hf-requests 2 --hf-batch 1 --out "$out/bench_n512.json" 2>&1 | tail -25 ;;
    bench)
      bench -n 50 --requests 400 --out "$out/bench_n50.json" --profile "$out/profile_n50.txt" 2>&1 | tail -25
      bench -n 512 --requests 64 --hf-requests 2 --hf-batch 1 --out "$out/bench_n512.json" 2>&1 | tail -25 ;;
    ablations)  # each against the default run (Triton beam kernel, FP8, graphs) of `bench`
      bench -n 50 --requests 400 --beam-attention cascade --no-hf-baseline --out "$out/bench_n50_ficascade.json" 2>&1 | tail -18
      bench -n 50 --requests 400 --no-cascade --no-hf-baseline --out "$out/bench_n50_flat.json" 2>&1 | tail -18
      bench -n 50 --requests 400 --no-fp8 --no-hf-baseline --out "$out/bench_n50_bf16.json" 2>&1 | tail -18
      bench -n 50 --requests 400 --no-graphs --no-hf-baseline --out "$out/bench_n50_nographs.json" 2>&1 | tail -18
      bench -n 512 --requests 64 --beam-attention cascade --no-hf-baseline --out "$out/bench_n512_ficascade.json" 2>&1 | tail -18
      bench -n 512 --requests 64 --no-cascade --no-hf-baseline --out "$out/bench_n512_flat.json" 2>&1 | tail -18 ;;
    elementwise)  # SiLU-mul and RMSNorm -> FP8 alone, launch configurations against the copy floor.
      # KERNELS_BASE=DIR (a copy of another tree's flashrec_kernels/ under DIR, e.g. .ab/base
      # from `git archive REV flashrec_kernels | tar -x -C .ab/base`, carried): both trees'
      # default launches only, base first, into $out/base and $out (E2E_AB can run the engine on
      # the base too: "PYTHONPATH=.ab/base:/tmp/site")
      if [[ -n ${KERNELS_BASE:-} ]]; then
        on_base_kernels scripts/bench_elementwise.py --defaults 2>&1 | tail -20
        echo "--- this tree's kernels"
        timeout "$(left)" python3 scripts/bench_elementwise.py "$out" --defaults 2>&1 | tail -20
      else
        timeout "$(left)" python3 scripts/bench_elementwise.py "$out" 2>&1 | tail -60
      fi
      # ELEMENTWISE_GRAPHS=1: the sweep again, each launch replayed in a CUDA graph
      if [[ -n ${ELEMENTWISE_GRAPHS:-} ]]; then
        timeout "$(left)" python3 scripts/bench_elementwise.py "$out" --graphs 2>&1 | tail -60
      fi ;;
    streams)  # a step graph beside a prefill graph on streams of two priorities (scripts/bench_stream_priority.py)
      timeout "$(left)" python3 scripts/bench_stream_priority.py "$out" 2>&1 | tail -12 ;;
    gemm)  # the model's FP8 GEMMs alone by row count (scripts/bench_gemm.py): small waves' cost;
      # GEMM_GRAPHS=1 times them in CUDA graph replays over copies of the weights (--graphs)
      timeout "$(left)" python3 scripts/bench_gemm.py "$out" ${GEMM_GRAPHS:+--graphs} 2>&1 | tail -12 ;;
    gemm-table)  # this tree's flashrec_kernels with the gemm stage's table in place, in
      # /tmp/gemm_table (the graph-timed table where there is one), for an A/B in the same or a
      # later call on this machine: E2E_AB="PYTHONPATH=/tmp/gemm_table:/tmp/site"
      table=$out/fp8_gemm_tuned_graphs.json; [[ -f $table ]] || table=$out/fp8_gemm_tuned.json
      if [[ -f $table ]]; then
        rm -rf /tmp/gemm_table && mkdir -p /tmp/gemm_table && cp -r flashrec_kernels /tmp/gemm_table/
        dest=$(python3 -c "import torch; from flashrec_kernels.fp8_gemm_tables import config_file; print(config_file(torch.cuda.get_device_name()).name)")
        cp "$table" "/tmp/gemm_table/flashrec_kernels/fp8_gemm_configs/$dest" && echo "$table -> /tmp/gemm_table (as $dest)"
        diff <(python3 -m json.tool --sort-keys "flashrec_kernels/fp8_gemm_configs/$dest" 2>/dev/null) \
          <(python3 -m json.tool --sort-keys "$table") | head -40
      else
        echo "no launch table in $out: run the gemm stage first"
      fi ;;
    attention)  # beam-step attention alone: FlashInfer flat vs cascade vs the Triton beam kernel
      # ATTENTION_KV: the KV dtypes to run (default both; each compiles its FlashInfer kernels).
      # KERNELS_BASE=DIR (as for elementwise): the Triton kernel's default launch only, the base
      # tree's first (into $out/base), each with its max |diff| to FlashInfer's cascade;
      # ATTENTION_VARIANTS="NAME,..." (of the script's VARIANTS) timed beside this tree's
      for kv in ${ATTENTION_KV:-fp8 bf16}; do
        if [[ -n ${KERNELS_BASE:-} ]]; then
          on_base_kernels scripts/bench_attention.py --kv "$kv" --defaults
          echo "--- this tree's kernels, $kv"
          timeout "$(left)" python3 scripts/bench_attention.py "$out" --kv "$kv" --defaults \
            --variants="${ATTENTION_VARIANTS:-}"
        else
          timeout "$(left)" python3 scripts/bench_attention.py "$out" --kv "$kv"
        fi
      done ;;
    e2e|e2e-engine|e2e-server)  # what users run: Engine.generate on a checkpoint dir, flashrec serve under load
      ensure_checkpoint
      if [[ $what != e2e-server ]]; then
        # E2E_N: the widths to run (default all three; n=1024 with 16 requests, no manual flags);
        # E2E_ARGS: further bench flags (e.g. "--schedule decode_first", or "--trace-dir
        # $out/traces_engine": one more call under a profiler window), E2E_TAG their file suffix;
        # E2E_AB: more lists of flags separated by ';', each run after the first at every width
        # (file suffixes _b, _c, ...; a list may start with NAME=VALUE words, its environment)
        IFS=';' read -ra engine_variants <<< "${E2E_AB:-}"
        for spec in ${E2E_N:-50:400 512:64 1024:16}; do
          # shellcheck disable=SC2086  # E2E_ARGS is a list of flags
          engine_bench "$spec" "${E2E_TAG:-}" ${E2E_ARGS:-}
          tags=(_b _c _d _e)
          for i in "${!engine_variants[@]}"; do
            # shellcheck disable=SC2086
            engine_bench "$spec" "${tags[$i]}" ${engine_variants[$i]}
          done
        done
      fi
      [[ $what == e2e-engine ]] && continue
      # SERVE_ARGS: further serve flags, e.g. "--admission-delay-factor 1"; SERVE_AB: more lists
      # of flags separated by ';', each served and loaded after the first (file suffixes _b, _c, ...);
      # a list may start with NAME=VALUE words, the server's environment (OMP_NUM_THREADS=1 ...)
      # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
      serve_bench "" ${SERVE_ARGS:-}
      IFS=';' read -ra variants <<< "${SERVE_AB:-}"
      tags=(_b _c _d _e)
      for i in "${!variants[@]}"; do
        # shellcheck disable=SC2086
        serve_bench "${tags[$i]}" ${variants[$i]}
      done ;;
    server-ab)  # the server twice: admission every step (default), then --admission-delay-factor 1
      ensure_checkpoint
      serve_bench ""
      serve_bench _delay1 --admission-delay-factor 1 ;;
    filters)  # the cost of per-request item filters at n=512 (issue 13): none, 10k excluded, 1k allowed
      ensure_checkpoint
      # FILTER_CASES: comma-separated bench flags per run ("" = unfiltered), default all four
      IFS=, read -ra cases <<< "${FILTER_CASES-,--exclude-items 10000,--allow-items 1000,--filter-categories 10}"
      for f in "${cases[@]}"; do
        tag=$(echo "${f:-none}" | tr -c 'a-z0-9' '_')
        # shellcheck disable=SC2086  # $f is a list of flags
        timeout "$(left)" flashrec bench --engine "$ck" -n 512 --requests 64 $f --out "$out/filters_$tag.json" \
          2>&1 | grep -E "requests_per_s|percent|latency|eager|replays|items|categories|peak|invalid|short"
      done ;;
    syncs)  # every host-GPU synchronization in one Engine.generate (scripts/find_syncs.py)
      ensure_checkpoint
      timeout "$(left)" python3 scripts/find_syncs.py "$ck" "$out" -n 50 --requests 32 2>&1 | head -40 ;;
    thread-probe)  # the engine loop offline, on its thread, under closed loops, beside a GIL burner
      ensure_checkpoint
      for spec in ${PROBE_N:-50:400 512:64}; do
        timeout "$(left)" python3 scripts/engine_thread_probe.py "$ck" "$out" -n "${spec%:*}" \
          --requests "${spec#*:}" --concurrency "$(( ${spec#*:} )),$(( 2 * ${spec#*:} ))" 2>&1 | grep "^{"
      done ;;
    request-profile)  # one unloaded request: host time, GPU kernels, launches, blocking calls
      ensure_checkpoint
      timeout "$(left)" python3 scripts/profile_request.py "$ck" "$out" 2>&1 | grep -v "^USDT"
      gzip -f "$out"/trace_request_*.json ;;
    prefillattn)  # the Triton prefill kernel natively against its reference, then alone against
      # FlashInfer's prefill (scripts/bench_prefill_attention.py)
      # PREFILL_TESTS=0: the bench alone, without the kernel's tests
      [[ ${PREFILL_TESTS:-1} == 0 ]] || pytest_gpu "$out/prefill_kernel_tests.log" tests/kernels/test_prefill_attention.py
      # PREFILL_CASES: a substring of the case names to run (default all)
      timeout "$(left)" python3 scripts/bench_prefill_attention.py "$out" "${PREFILL_CASES:-}" 2>&1 \
        | tee "$out/bench_prefill_attention.log" | grep -v "^  running" | tail -12
      # PREFILL_AB=DIR: the bench again with DIR first on PYTHONPATH (a base tree's kernels as
      # DIR/flashrec_kernels, docs/development.md), into $out/base
      if [[ -n ${PREFILL_AB:-} ]]; then
        mkdir -p "$out/base"
        PYTHONPATH="$PREFILL_AB:$PYTHONPATH" timeout "$(left)" python3 scripts/bench_prefill_attention.py \
          "$out/base" "${PREFILL_CASES:-}" 2>&1 | tee "$out/base/bench_prefill_attention.log" \
          | grep -v "^  running" | tail -12
      fi ;;
    prefillacc)  # beam scores vs fp32 transformers with the Triton and FlashInfer prefills, every
      # architecture (scripts/diagnose_prefill_accuracy.py; ACC_QUANT=none for BF16 weights)
      timeout "$(left)" python3 scripts/diagnose_prefill_accuracy.py "$out" "--quantization" \
        "${ACC_QUANT:-fp8}" 2>&1 | grep -vE "Warning|warn|Writing model" ;;
    freshab)  # prefills through the Triton prefill kernel, then the fresh prefill (auto's choice
      # on sm90): one request's profile at both widths, then Engine.generate (FRESHAB_N="N:REQUESTS")
      request_ab "${FRESHAB_N:-50:400}" freshab "--prefill-attention triton" "--prefill-attention fresh" _fresh ;;
    prefillab)  # prefills through the Triton prefill kernel and FlashInfer: one request's
      # profile at both widths, then Engine.generate (PREFILLAB_N="N:REQUESTS"), each A then B
      request_ab "${PREFILLAB_N:-50:400}" prefillab "--prefill-attention triton" "--prefill-attention backend" _backend ;;
    server-profile)  # the engine thread under cProfile while the server takes open-loop load
      ensure_checkpoint
      flashrec serve --model-path "$ck" --catalog "$ck/catalog.json" --warmup-n 50 --port 8124 \
        --profile-engine "$out/engine_profile.txt" > "$out/serve_profile.log" 2>&1 &
      srv=$!
      wait_ready 8124 || { stop_server $srv; continue; }
      timeout "$(left)" flashrec bench --server http://127.0.0.1:8124 --model-dir "$ck" -n 50 --requests 200 \
        --concurrency 200 --rates 0.7 --out "$out/server_profile_n50.json" 2>&1 | grep -E "throughput|p50|busy|per_wave|lag|mean_ms"
      stop_server $srv; head -70 "$out/engine_profile.txt" ;;
    compare)  # the reference engine and ours: same checkpoint, catalog, prompts and timing
      ensure_checkpoint
      # its own --target dir, on PYTHONPATH for the script only (it runs on the deps in /tmp/site)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/refsite \
        .whl/ref/flashrec-*.whl || { echo "reference wheel install failed"; continue; }
      # --cache-fill 0 unless COMPARE_ARGS sets it: the script's default fills 90% of each
      # engine's KV pool before timing, which the reference alone could not finish in a 7-minute
      # stage on an H100 (session 40); a later --cache-fill in COMPARE_ARGS wins
      # shellcheck disable=SC2086  # COMPARE_ARGS is a list of flags
      PYTHONPATH=/tmp/refsite:$PYTHONPATH timeout "$(left)" python3 scripts/compare_reference.py --ckpt "$ck" \
        --out "$out" --cache-fill 0 ${COMPARE_ARGS:-} 2>&1 | tee "$out/compare_reference.log" | tail -45 ;;
    diagnose)  # which engine path scores beams unlike fp32 transformers (one switch per case)
      timeout "$(left)" python3 scripts/diagnose_gpu_search.py "$out" 2>&1 | grep -v Writing ;;
    *) echo "unknown stage $what"; exit 2 ;;
  esac
done
