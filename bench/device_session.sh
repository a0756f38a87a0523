#!/usr/bin/env bash
# One lent GPU box (16 cores and an H100/H200, no network), both device checks in one command: a
# session gets 15 minutes of device time, start-up included, and each check alone is sized for 8.
#   1. bench/gpu/check.sh (issue 37) within GPU_BUDGET seconds; llama.cpp's CPU build runs beside its
#      untimed first steps (setup, the GPU kernel tests, correctness), at a lower priority
#   2. bench/many_cores/run.sh (issue 36) within what is left of BUDGET, over the native core that
#      step 1 built and the llama.cpp build of step 1 (no second compile); THREADS / GEMMA_THREADS
#      default to the counts the targets name
# Everything lands in $OUT as at most 8 files (what comes back from the box): gpu-summary.txt,
# cores-summary.txt, results.tar.gz (both runs' logs and JSON), session.log.
#
#   bash bench/gpu/prepare.sh && bash bench/many_cores/prepare.sh     # here, with PyPI reachable
#   run: carry [".carry", ".carry-gpu"], command `bash bench/device_session.sh`, timeout_s 590
#
# Env: BUDGET (seconds for the whole, default 540), GPU_BUDGET (default 320), TM_PYTHON, JOBS,
# THREADS (default "default,16,8,4"), GEMMA_THREADS (default "default"), GPU_STEPS (default
# env,kernel-tests,correctness,decode,concurrency,invariance,anchor,profile), T_TESTS (the GPU tests'
# limit, 110 s: ~75 tests, beside the native build), SKIP_GPU=1 / SKIP_CORES=1, SKIP_SMOLLM2=1 and
# SPIN_US (passed to run.sh),
# SKIP_LLAMA_BUILD=1 (tokenmill alone in step 2), NATIVE_PREBUILT (step 2's native core, for a check
# elsewhere with step 1 dry: DEVICE=cpu SMALL=1 NATIVE=0 pass through to check.sh).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
FINAL=$(mkdir -p "${OUT:-$ROOT/out}" && cd "${OUT:-$ROOT/out}" && pwd)
SCRATCH=${TMPDIR:-/tmp}/tokenmill-session
BUDGET=${BUDGET:-540}
GPU_BUDGET=${GPU_BUDGET:-320}
JOBS=${JOBS:-$(nproc)}
START=$(date +%s)
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH/gpu" "$SCRATCH/cores" "$SCRATCH/llama"
: > "$FINAL/session.log"

log() { echo "[session $(date +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$FINAL/session.log"; }

pack() {  # what comes back: the two summaries alone, the rest in one archive
    [[ -s "$SCRATCH/gpu/out/run.log" ]] && cp "$SCRATCH/gpu/out/run.log" "$FINAL/gpu-summary.txt"
    [[ -s "$SCRATCH/cores/out/summary.txt" ]] && cp "$SCRATCH/cores/out/summary.txt" "$FINAL/cores-summary.txt"
    tar -czf "$FINAL/results.tar.gz.tmp" -C "$SCRATCH" gpu/out cores/out llama/build.log 2>/dev/null
    mv -f "$FINAL/results.tar.gz.tmp" "$FINAL/results.tar.gz"
}

log "box: $(nproc) CPUs ($(lscpu 2>/dev/null | grep -E '^(Thread|Core|Socket)' | tr -s ' ' | tr '\n' ';')), $(nvidia-smi -L 2>/dev/null | head -1)"
grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_vnni|avx512_bf16|amx_int8|amx_bf16|avx_vnni)$' \
    | tr '\n' ' ' | sed 's/^/cpu flags: /' | tee -a "$FINAL/session.log"; echo | tee -a "$FINAL/session.log"

# llama.cpp for step 2, built at low priority beside step 1's untimed steps; run.sh takes it as
# LLAMA_PREBUILT. On an AMX CPU without AMX code, as run.sh builds it (see there).
llama_pid=""
if [[ "${SKIP_CORES:-0}" != 1 && "${SKIP_LLAMA_BUILD:-0}" != 1 ]]; then
    (
        set -e
        tar -xzf "$(ls "$ROOT"/.carry/llama_cpp_python-*-stripped.tar.gz | head -1)" -C "$SCRATCH/llama"
        src=$(ls -d "$SCRATCH"/llama/llama_cpp_python-*/)
        isa="-DGGML_NATIVE=ON"
        if grep -qw amx_int8 /proc/cpuinfo; then
            isa="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
                 -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF
                 -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        fi
        # shellcheck disable=SC2086
        cmake -S "$src/vendor/llama.cpp" -B "$SCRATCH/llama/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
            $isa -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
        CMAKE_BUILD_PARALLEL_LEVEL=$JOBS nice -n 10 cmake --build "$SCRATCH/llama/build" \
            --target llama llama-bench llama-batched-bench
        echo "llama.cpp built at +$(($(date +%s) - START))s"
    ) > "$SCRATCH/llama/build.log" 2>&1 &
    llama_pid=$!
    log "llama.cpp: building in the background"
fi

if [[ "${SKIP_GPU:-0}" != 1 ]]; then
    log "step 1: GPU check, budget ${GPU_BUDGET}s"
    OUT="$SCRATCH/gpu/out" WORK="$SCRATCH/gpu/work" BUDGET=$GPU_BUDGET JOBS=$JOBS T_TESTS=${T_TESTS:-110} \
        STEPS=${GPU_STEPS:-env,kernel-tests,correctness,decode,concurrency,invariance,anchor,profile} \
        timeout -k 5 $((GPU_BUDGET + 40)) bash "$ROOT/bench/gpu/check.sh"
    log "step 1 done"
    pack
fi

if [[ -n "$llama_pid" ]]; then
    if wait "$llama_pid"; then log "llama.cpp built"; else log "llama.cpp build FAILED: $(tail -n 3 "$SCRATCH/llama/build.log")"; fi
fi

if [[ "${SKIP_CORES:-0}" != 1 ]]; then
    left=$((BUDGET - ($(date +%s) - START) - 10))
    log "step 2: many-core scaling, budget ${left}s"
    # step 1's native core (a folder of _native_*.so), else run.sh compiles its own
    native=${NATIVE_PREBUILT:-$SCRATCH/gpu/work/native/tokenmill}
    ls "$native"/_native_*.so > /dev/null 2>&1 || native=""
    # no llama.cpp built above: tokenmill alone rather than a second compile inside the budget
    [[ -x "$SCRATCH/llama/build/bin/llama-bench" ]] && llama=$SCRATCH/llama/build || llama=""
    OUT="$SCRATCH/cores/out" WORK="$SCRATCH/cores/work" BUDGET=$left JOBS=$JOBS \
        NATIVE_PREBUILT=$native LLAMA_PREBUILT=$llama SKIP_LLAMA_BUILD=$([[ -z "$llama" ]] && echo 1 || echo 0) \
        THREADS=${THREADS:-default,16,8,4} GEMMA_THREADS=${GEMMA_THREADS:-default} STEP_TIMEOUT=${STEP_TIMEOUT:-60} \
        GEMMA_RESERVE=${GEMMA_RESERVE:-45} T_SETUP=40 T_MODELS=40 \
        timeout -k 5 $((left + 20)) bash "$ROOT/bench/many_cores/run.sh"
    log "step 2 done"
fi
pack
log "done"
