#!/usr/bin/env bash
# Measures `tokenmill bench scaling` on a bare many-core Linux box with no network, from what
# prepare.sh put in .carry/: builds tokenmill's native core and llama.cpp there, rebuilds SmolLM2 and
# Gemma 3 (their shapes, random weights) from the model skeletons, and runs
#   SmolLM2:  single-stream decode, pp512 and 64-sequence decode at THREADS (default: the default
#             count, 16, 8, 4, 2, 1; most important first, so a run cut short keeps those)
#   Gemma 3:  single-stream decode at GEMMA_THREADS (default: the default count and 16)
# each against llama.cpp at the same thread count (its own llama-bench and llama-batched-bench, built
# from the carried llama-cpp-python sdist's vendor/llama.cpp; the sdist's Python package runs over
# the same libllama). Every step runs under `timeout`, the whole within BUDGET seconds; a failed step
# is reported and the rest goes on where it can. Results: $OUT (default ./out): summary.txt (also
# printed last), smollm2.{json,txt}, gemma3.{json,txt}, run.log, logs/*.log.
#
#   bash bench/many_cores/run.sh                       # on the box: python at /opt/torch/.venv
#   TM_PYTHON=.venv/bin/python THREADS=1,2 SKIP_LLAMA_BUILD=1 bash bench/many_cores/run.sh   # a quick check
#
# Env: TM_PYTHON (python with torch, numpy, tokenizers, jinja2; default /opt/torch/.venv/bin/python3),
# CARRY (.carry), OUT, WORK (scratch: venv, builds, models; default $TMPDIR/tokenmill-many-cores),
# JOBS (build jobs, default nproc), BUDGET (seconds, default 470), THREADS, GEMMA_THREADS,
# STEP_TIMEOUT (seconds per side and thread count inside the bench, default 90), BENCH_ARGS (more
# options for the SmolLM2 bench), SKIP_LLAMA_BUILD=1 (no llama.cpp: tokenmill alone),
# LLAMA_PREBUILT (a llama.cpp build folder with bin/ from an earlier run: no rebuild), NATIVE_PREBUILT
# (a folder with tokenmill's _native_*.so for this python: no compile; for checks elsewhere), the steps'
# limits T_SETUP (60), T_BUILD (200), T_MODELS (60), T_SMOLLM2 (400), T_GEMMA3 (120) and
# GEMMA_RESERVE (50: seconds of the budget the SmolLM2 run leaves to Gemma 3), SKIP_SMOLLM2=1 (Gemma 3
# alone), SPIN_US (also the Gemma 3 run with TOKENMILL_SPIN_US=SPIN_US), LLAMA_AMX=1 (build
# llama.cpp with -march=native on an AMX CPU too; by default its AMX code is left out there).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export CARRY=${CARRY:-$ROOT/.carry}
export TM_PYTHON=${TM_PYTHON:-/opt/torch/.venv/bin/python3}
export OUT=$(mkdir -p "${OUT:-$ROOT/out}" && cd "${OUT:-$ROOT/out}" && pwd)
export WORK=${WORK:-${TMPDIR:-/tmp}/tokenmill-many-cores}
export JOBS=${JOBS:-$(nproc)}
BUDGET=${BUDGET:-470}
THREADS=${THREADS:-default,16,8,4,2,1}
GEMMA_THREADS=${GEMMA_THREADS:-default,16}
SPIN_US=${SPIN_US:-}
STEP_TIMEOUT=${STEP_TIMEOUT:-90}
BENCH_ARGS=${BENCH_ARGS:-}
export VENV=$WORK/venv
export ROOT

START=$(date +%s)
mkdir -p "$OUT/logs" "$WORK"
: > "$OUT/run.log"
: > "$OUT/failed.txt"

log() {
    local line="[$(date +%H:%M:%S) +$(($(date +%s) - START))s] $*"
    echo "$line"
    echo "$line" >> "$OUT/run.log"
}

# step NAME LIMIT FUNCTION: FUNCTION under `timeout` (LIMIT, or less if the budget has less left),
# its output in logs/NAME.log; a failure is logged with the log's tail and noted in failed.txt.
step() {
    local name=$1 limit=$2 fn=$3 left rc
    left=$((BUDGET - ($(date +%s) - START)))
    ((left < limit)) && limit=$left
    if ((limit < 5)); then
        log "SKIPPED $name: the ${BUDGET}s budget is spent"
        echo "$name (no time left)" >> "$OUT/failed.txt"
        return 99
    fi
    log "start $name (limit ${limit}s)"
    timeout -k 5 "$limit" bash -c "$fn" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    if ((rc == 0)); then
        log "ok    $name"
    else
        log "FAILED $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
        tail -n 6 "$OUT/logs/$name.log" | sed 's/^/        /' | tee -a "$OUT/run.log"
        echo "$name (exit $rc)" >> "$OUT/failed.txt"
    fi
    return $rc
}

# --- the steps (functions run in a child bash: exported) ------------------------------------------

pip_() { "$VENV/bin/python" "$(ls "$CARRY"/wheels/pip-*.whl | head -1)/pip" "$@"; }

setup_venv() {
    set -e
    rm -rf "$VENV"
    "$TM_PYTHON" -m venv --without-pip --system-site-packages "$VENV"
    # The box's python may itself be a venv (torch lives there, not in the base interpreter that
    # --system-site-packages reaches): add its site folders after the new venv's own.
    local sp base
    sp=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    base=$("$TM_PYTHON" -c 'import sys; print([p for p in sys.path if p.endswith(("site-packages", "dist-packages"))])')
    echo "import site; list(map(site.addsitedir, $base))" > "$sp/zz_base_python.pth"
    pip_ install --no-index --find-links "$CARRY/wheels" gguf tqdm pyyaml requests diskcache \
        'pybind11>=2.12' 'setuptools>=68'
    # the server's packages: the bench does not need them, so a failure here is only reported
    pip_ install --no-index --find-links "$CARRY/wheels" starlette uvicorn llguidance || echo "server packages: not installed"
    "$VENV/bin/python" -c 'import torch, numpy, gguf, tokenizers, jinja2; print("torch", torch.__version__)'
}

build_tokenmill() {
    set -e
    cd "$ROOT"
    if [[ -n "${NATIVE_PREBUILT:-}" ]]; then  # a quick check elsewhere: modules built before, no compile
        cp "$NATIVE_PREBUILT"/_native_*.so src/tokenmill/
        TOKENMILL_NATIVE=0 pip_ install --no-index --no-build-isolation --no-deps -e .
    else
        TOKENMILL_BUILD_JOBS=$JOBS pip_ install --no-index --no-build-isolation --no-deps -e .
    fi
    "$VENV/bin/python" -c 'from tokenmill.kernels import native; print("native core:", native.describe())'
}

build_llama() {
    set -e
    rm -rf "$WORK/llama"
    mkdir -p "$WORK/llama"
    tar -xzf "$(ls "$CARRY"/llama_cpp_python-*-stripped.tar.gz | head -1)" -C "$WORK/llama"
    local src build
    src=$(ls -d "$WORK"/llama/llama_cpp_python-*/)
    build=${LLAMA_PREBUILT:-$WORK/llama/build}
    if [[ -z "${LLAMA_PREBUILT:-}" ]]; then
        # -march=native, except on an AMX CPU: there ggml's AMX matmul died on its first tile load
        # (SIGILL at tileloadd here, a GPF at ldtilecfg before: README, gcc 12, Sapphire Rapids), so
        # the AVX-512 code without AMX, as the README's peer build; LLAMA_AMX=1 tries AMX anyway.
        local isa="-DGGML_NATIVE=ON"
        if grep -qw amx_int8 /proc/cpuinfo && [[ "${LLAMA_AMX:-0}" != 1 ]]; then
            isa="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
                 -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF
                 -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
            echo "llama.cpp: AVX-512 without AMX"
        fi
        # shellcheck disable=SC2086
        cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON $isa \
            -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
        CMAKE_BUILD_PARALLEL_LEVEL=$JOBS cmake --build "$build" --target llama llama-bench llama-batched-bench
    fi
    ln -sfn "$build/bin" "$WORK/llama/bin"
    # llama-cpp-python: its Python package used in place, over this build's shared libraries
    rm -rf "$src/llama_cpp/lib"
    ln -s "$build/bin" "$src/llama_cpp/lib"
    echo "$src" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llama_cpp_python.pth"
    "$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
    "$WORK/llama/bin/llama-bench" --help > /dev/null
}

make_models() {
    set -e
    local sk=$CARRY/model-skeletons
    "$VENV/bin/python" "$sk/model_skeleton.py" build "$sk/smollm2-135m-q4_1.json" "$WORK/smollm2.gguf"
    "$VENV/bin/python" "$sk/model_skeleton.py" build "$sk/gemma3-270m-q4_k_m.json" "$WORK/gemma3.gguf"
    ls -la "$WORK"/*.gguf
}

llama_args() {
    local a=""
    [[ -x "$WORK/llama/bin/llama-bench" ]] && a="$a --llama-bench $WORK/llama/bin/llama-bench"
    [[ -x "$WORK/llama/bin/llama-batched-bench" ]] && a="$a --llama-batched-bench $WORK/llama/bin/llama-batched-bench"
    [[ -z "$a" ]] && ! "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null && a="--skip-llama-cpp"
    echo "$a"
}

bench_smollm2() {
    "$VENV/bin/tokenmill" bench scaling --model "$WORK/smollm2.gguf" --threads "$THREADS" --repeats 2 \
        --timeout "$STEP_TIMEOUT" $(llama_args) $BENCH_ARGS --json "$OUT/smollm2.json" > "$OUT/smollm2.txt"
}

bench_gemma3() {  # bench_gemma3 [NAME]: NAME.json/.txt (default gemma3)
    local name=${1:-gemma3}
    "$VENV/bin/tokenmill" bench scaling --model "$WORK/gemma3.gguf" --tests tg --threads "$GEMMA_THREADS" \
        --repeats 3 --timeout "$STEP_TIMEOUT" $(llama_args) --json "$OUT/$name.json" > "$OUT/$name.txt"
}

export -f pip_ setup_venv build_tokenmill build_llama make_models llama_args bench_smollm2 bench_gemma3
export THREADS GEMMA_THREADS STEP_TIMEOUT BENCH_ARGS SPIN_US LLAMA_PREBUILT=${LLAMA_PREBUILT:-} NATIVE_PREBUILT=${NATIVE_PREBUILT:-}

# --- the run --------------------------------------------------------------------------------------
log "box: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), python $TM_PYTHON, budget ${BUDGET}s"

if step setup "${T_SETUP:-60}" setup_venv; then
    # The two builds overlap: tokenmill's is bound by its slowest file per variant, llama.cpp's
    # keeps the other cores busy meanwhile.
    step build-tokenmill "${T_BUILD:-200}" build_tokenmill &
    tm_pid=$!
    if [[ "${SKIP_LLAMA_BUILD:-0}" == 1 ]]; then
        log "llama.cpp build skipped (SKIP_LLAMA_BUILD=1)"
    else
        step build-llama "${T_BUILD:-200}" build_llama &
        llama_pid=$!
    fi
    step models "${T_MODELS:-60}" make_models
    wait "$tm_pid"
    [[ -n "${llama_pid:-}" ]] && wait "$llama_pid"
    if [[ -x "$VENV/bin/tokenmill" && -f "$WORK/smollm2.gguf" ]]; then
        if [[ "${SKIP_SMOLLM2:-0}" != 1 ]]; then
            BUDGET=$((BUDGET - ${GEMMA_RESERVE:-50})) step bench-smollm2 "${T_SMOLLM2:-400}" bench_smollm2
            # a run cut short still wrote the thread counts it finished: report those
            if [[ -s "$OUT/smollm2.json" ]]; then
                "$VENV/bin/tokenmill" bench scaling --from-json "$OUT/smollm2.json" > "$OUT/smollm2.txt" 2>/dev/null
            fi
        fi
        step bench-gemma3 "${T_GEMMA3:-120}" bench_gemma3
        if [[ -s "$OUT/gemma3.json" ]]; then
            "$VENV/bin/tokenmill" bench scaling --from-json "$OUT/gemma3.json" > "$OUT/gemma3.txt" 2>/dev/null
        fi
        if [[ -n "$SPIN_US" ]]; then  # the same Gemma 3 run with the pool's workers spinning longer
            TOKENMILL_SPIN_US=$SPIN_US step bench-gemma3-spin "${T_GEMMA3:-120}" "bench_gemma3 gemma3-spin$SPIN_US"
        fi
    else
        log "no benchmark: tokenmill or the model is missing (see the failures above)"
    fi
fi

{
    echo "== tokenmill many-core scaling: $(date -u +%FT%TZ), $(nproc) CPUs, $(($(date +%s) - START)) s"
    if [[ -s "$OUT/failed.txt" ]]; then echo "failed steps:"; sed 's/^/  /' "$OUT/failed.txt"; else echo "every step ok"; fi
    grep -h "^llama.cpp: \|^native core: \|^torch " "$OUT"/logs/setup.log "$OUT"/logs/build-*.log 2>/dev/null
    for m in smollm2 gemma3 ${SPIN_US:+gemma3-spin$SPIN_US}; do
        if [[ -s "$OUT/$m.txt" ]]; then echo; echo "== $m"; cat "$OUT/$m.txt"; fi
    done
} > "$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
