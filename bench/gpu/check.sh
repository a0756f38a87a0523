#!/usr/bin/env bash
# Checks tokenmill's CUDA path on a bare GPU box with no network (issue 37 item 8), from what
# prepare.sh put in .carry-gpu/: a venv over the box's python (torch with CUDA, triton), the carried
# wheels, tokenmill installed in place, its native CPU core built in the background (the CPU path is
# the correctness reference), SmolLM2 and Gemma 3 rebuilt with random weights from the skeletons; then
# bench/gpu/check.py's steps, each in its own process under `timeout`, most important first, the whole
# within BUDGET seconds:
#   env, kernel-tests (while the native core builds), correctness, decode, concurrency, invariance,
#   anchor (transformers), kernel-bench, summary
# A failed step is logged with its tail and the rest goes on. Results in $OUT (default ./out):
# summary.txt (printed last), <step>.json, run.log, logs/<step>.log.
#
#   bash bench/gpu/check.sh                                     # on the GPU box
#   DEVICE=cpu SMALL=1 NATIVE=0 TM_PYTHON=.venv/bin/python bash bench/gpu/check.sh   # a dry run here
#
# Env: TM_PYTHON (the box's python with torch; default /opt/torch/.venv/bin/python3), CARRY
# (.carry-gpu), OUT, WORK (scratch: venv, models, native build; default $TMPDIR/tokenmill-gpu-check),
# JOBS (native build jobs; default nproc), BUDGET (seconds, default 470), DEVICE (cuda; cpu: a dry run),
# SMALL=1 (tiny sizes), NATIVE=0 (no native build: the CPU path runs on PyTorch), STEPS (the check.py
# steps to run, default all), the steps' limits T_SETUP (90), T_INSTALL (60), T_NATIVE (240),
# T_MODELS (60), T_TESTS (150), T_CORRECTNESS (120), T_DECODE (75), T_CONCURRENCY (100),
# T_INVARIANCE (60), T_ANCHOR (100), T_KBENCH (60), T_PROFILE (90; a step run only when STEPS names it).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export ROOT
export CARRY=${CARRY:-$ROOT/.carry-gpu}
export TM_PYTHON=${TM_PYTHON:-/opt/torch/.venv/bin/python3}
export OUT=$(mkdir -p "${OUT:-$ROOT/out}" && cd "${OUT:-$ROOT/out}" && pwd)
export WORK=${WORK:-${TMPDIR:-/tmp}/tokenmill-gpu-check}
export JOBS=${JOBS:-$(nproc)}
export DEVICE=${DEVICE:-cuda}
export VENV=$WORK/venv
BUDGET=${BUDGET:-470}
STEPS=${STEPS:-env,kernel-tests,correctness,decode,concurrency,invariance,anchor,kernel-bench}
SIZE_FLAG=""
[[ "${SMALL:-0}" == 1 ]] && SIZE_FLAG="--small"
export SIZE_FLAG

START=$(date +%s)
mkdir -p "$OUT/logs" "$WORK"
: > "$OUT/run.log"
: > "$OUT/failed.txt"

log() {
    local line="[$(date +%H:%M:%S) +$(($(date +%s) - START))s] $*"
    echo "$line"
    echo "$line" >> "$OUT/run.log"
}

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT COMMAND...: COMMAND under `timeout` (LIMIT, or what the budget has left), its
# output in logs/NAME.log; a failure is logged with the log's tail and noted in failed.txt.
step() {
    local name=$1 limit=$2 rc
    shift 2
    (( $(left) < limit )) && limit=$(left)
    if ((limit < 5)); then
        log "SKIPPED $name: the ${BUDGET}s budget is spent"
        echo "$name (no time left)" >> "$OUT/failed.txt"
        return 99
    fi
    log "start $name (limit ${limit}s)"
    STEP_LIMIT=$limit timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    if ((rc == 0)); then
        log "ok    $name"
    else
        log "FAILED $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
        tail -n 8 "$OUT/logs/$name.log" | sed 's/^/        /' | tee -a "$OUT/run.log"
        echo "$name (exit $rc)" >> "$OUT/failed.txt"
    fi
    return $rc
}

# --- the steps (run in a child bash: exported) ----------------------------------------------------

pip_() {
    if "$VENV/bin/python" -m pip --version > /dev/null 2>&1; then
        "$VENV/bin/python" -m pip "$@"
    else  # the box's python has no pip: run it from its wheel
        "$VENV/bin/python" "$(ls "$CARRY"/wheels/pip-*.whl | head -1)/pip" "$@"
    fi
}

setup_venv() {
    set -e
    rm -rf "$VENV"
    "$TM_PYTHON" -m venv --without-pip --system-site-packages "$VENV"
    # The box's python may itself be a venv (torch lives in it, not in the base interpreter that
    # --system-site-packages reaches): its site folders go after the new venv's own.
    local sp base
    sp=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    base=$("$TM_PYTHON" -c 'import sys; print([p for p in sys.path if p.endswith(("site-packages", "dist-packages"))])')
    echo "import site; list(map(site.addsitedir, $base))" > "$sp/zz_box_python.pth"
    pip_ install --disable-pip-version-check --no-index --find-links "$CARRY/wheels" \
        gguf starlette uvicorn llguidance pytest 'pybind11>=2.12' 'setuptools>=68'
    "$VENV/bin/python" -c '
import torch, numpy, gguf, tokenizers, jinja2, pytest, starlette, uvicorn, llguidance
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
try:
    import transformers; hv = transformers.__version__
except ImportError:
    hv = None
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "| triton", tv, "| transformers", hv, "| gguf, starlette, uvicorn, llguidance, pytest: ok")'
}

install_tokenmill() {
    set -e
    cd "$ROOT"
    # Without the native core here (seconds): build_native compiles it beside the first steps.
    TOKENMILL_NATIVE=0 pip_ install --disable-pip-version-check --no-index --no-build-isolation --no-deps -e .
    "$VENV/bin/python" -c 'import tokenmill.server, tokenmill.kernels.gpu; print("tokenmill installed")'
}

build_native() {
    set -e
    cd "$ROOT"
    rm -rf "$WORK/native" "$WORK/native-tmp"
    TOKENMILL_BUILD_JOBS=$JOBS nice -n 5 "$VENV/bin/python" setup.py -q build_ext \
        --build-lib "$WORK/native" --build-temp "$WORK/native-tmp"
    # Into the package by rename: a step starting meanwhile imports a whole module or none.
    local so
    for so in "$WORK"/native/tokenmill/_native_*.so; do
        cp "$so" "src/tokenmill/.$(basename "$so").tmp"
        mv -f "src/tokenmill/.$(basename "$so").tmp" "src/tokenmill/$(basename "$so")"
    done
    "$VENV/bin/python" -c 'from tokenmill.kernels import native; print("native core:", native.describe())'
}

make_models() {
    set -e
    local sk=$CARRY/model-skeletons
    "$VENV/bin/python" "$sk/model_skeleton.py" build "$sk/smollm2-135m-q4_1.json" "$WORK/smollm2.gguf"
    "$VENV/bin/python" "$sk/model_skeleton.py" build "$sk/gemma3-270m-q4_k_m.json" "$WORK/gemma3.gguf"
    ls -la "$WORK"/*.gguf
}

check() {  # check STEP: one step of check.py; pytest and the kernel bench stop 10 s before the limit
    cd "$ROOT"
    "$VENV/bin/python" bench/gpu/check.py --device "$DEVICE" $SIZE_FLAG --out "$OUT" \
        --model smollm2="$WORK/smollm2.gguf" --model gemma3="$WORK/gemma3.gguf" \
        --timeout $((STEP_LIMIT > 20 ? STEP_LIMIT - 10 : STEP_LIMIT)) --steps "$1" ${CHECK_ARGS:-}
}

export -f pip_ setup_venv install_tokenmill build_native make_models check

# --- the run --------------------------------------------------------------------------------------
log "box: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); python $TM_PYTHON;" \
    "device $DEVICE; budget ${BUDGET}s; $(nvidia-smi -L 2>/dev/null | head -1)"

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

if step setup "${T_SETUP:-90}" bash -c setup_venv && step install "${T_INSTALL:-60}" bash -c install_tokenmill; then
    native_pid=""
    if [[ "${NATIVE:-1}" == 1 ]]; then
        log "native core: building in the background (${JOBS} jobs)"
        step native "${T_NATIVE:-240}" bash -c build_native &
        native_pid=$!
    fi
    step models "${T_MODELS:-60}" bash -c make_models
    wanted env && step env 30 bash -c "check env"
    wanted kernel-tests && step kernel-tests "${T_TESTS:-150}" bash -c "check kernel-tests"
    if [[ -n "$native_pid" ]]; then
        log "waiting for the native core"
        wait "$native_pid"
        # the env step ran before it: record what the CPU path runs now
        wanted env && step env 30 bash -c "check env"
    fi
    wanted correctness && step correctness "${T_CORRECTNESS:-120}" bash -c "check correctness"
    wanted decode && step decode "${T_DECODE:-75}" bash -c "check decode"
    wanted concurrency && step concurrency "${T_CONCURRENCY:-100}" bash -c "check concurrency"
    wanted invariance && step invariance "${T_INVARIANCE:-60}" bash -c "check invariance"
    wanted anchor && step anchor "${T_ANCHOR:-100}" bash -c "check anchor"
    wanted kernel-bench && step kernel-bench "${T_KBENCH:-60}" bash -c "check kernel-bench"
    wanted profile && step profile "${T_PROFILE:-90}" bash -c "check profile"
    BUDGET=$((BUDGET + 30)) step summary 20 bash -c "check summary"
fi

{
    echo
    echo "== tokenmill GPU check: $(date -u +%FT%TZ), $(($(date +%s) - START)) s"
    if [[ -s "$OUT/failed.txt" ]]; then echo "failed steps:"; sed 's/^/  /' "$OUT/failed.txt"; else echo "every step ok"; fi
    [[ -s "$OUT/summary.txt" ]] && cat "$OUT/summary.txt"
} | tee -a "$OUT/run.log"
