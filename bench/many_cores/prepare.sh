#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what bench/many_cores/run.sh needs on a box with no network:
#   .carry/wheels/            cp312 manylinux wheels of tokenmill's run-time dependencies the box
#                             lacks (requirements.txt beside this script), pybind11 and setuptools
#   .carry/llama_cpp_python-VERSION-stripped.tar.gz
#                             the llama-cpp-python sdist without what building llama.cpp's library and
#                             its two benchmark tools does not read (vocab models, docs, web UI, ...):
#                             the whole sdist is ~75 MB, over what travels to a lent machine
#   .carry/model-skeletons/   ../shared/model-skeletons (SmolLM2 and Gemma 3 shapes, random weights)
# Run it here, with PyPI reachable:  bash bench/many_cores/prepare.sh
# Env: PYTHON (a python with pip; default .venv/bin/python), CARRY (default .carry),
#      SKELETONS (default ../shared/model-skeletons), CHECK_BUILD=1 also builds the stripped tree's
#      llama.cpp here once (minutes on 2 cores) to prove nothing it needs was stripped.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CARRY=${CARRY:-$ROOT/.carry}
SKELETONS=${SKELETONS:-$ROOT/../shared/model-skeletons}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LIMIT_MIB=${LIMIT_MIB:-55}  # the lent machine takes 64 MiB of checkout and carry together

mkdir -p "$CARRY/wheels"
echo "== wheels for cp312 manylinux x86_64 -> $CARRY/wheels"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -r "$HERE/requirements.txt" -d "$CARRY/wheels"

SDIST="$CARRY/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-stripped.tar.gz"
if [[ -f "$SDIST" ]]; then
    echo "== $SDIST already there"
else
    echo "== llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist, stripped"
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$TMP" 2>/dev/null ||
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$TMP"
    tar -xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
    SRC="$TMP/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    V="$SRC/vendor/llama.cpp"
    # Nothing in the library's or the tools' CMake reads these (tests, examples and the server's web
    # UI are built only when asked, and run.sh does not ask); the sdist's .git (a 38 MB pack of the
    # submodule's history) only gives the build its commit id.
    rm -rf "$V/models" "$V/docs" "$V/media" "$V/tools/ui" "$V/benches" "$V/examples" "$V/tests" \
           "$V/gguf-py" "$V/conversion" "$V/.github" "$V/skills" "$V"/convert_*.py "$V/.git" \
           "$SRC/docs" "$SRC/examples" "$SRC/tests" "$SRC/docker" "$SRC/.git"
    tar -czf "$SDIST" -C "$TMP" "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    rm -rf "$TMP"
    trap - EXIT
fi

echo "== model skeletons from $SKELETONS"
rm -rf "$CARRY/model-skeletons"
mkdir -p "$CARRY/model-skeletons"
cp "$SKELETONS"/model_skeleton.py "$SKELETONS"/*.json "$CARRY/model-skeletons/"
chmod u+w "$CARRY"/model-skeletons/*

if [[ "${CHECK_BUILD:-0}" == 1 ]]; then
    echo "== checking that the stripped llama.cpp still builds (CHECK_BUILD=1)"
    CHECK=$(mktemp -d)
    tar -xzf "$SDIST" -C "$CHECK"
    cmake -S "$CHECK"/llama_cpp_python-*/vendor/llama.cpp -B "$CHECK/build" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF >/dev/null
    cmake --build "$CHECK/build" -j"$(nproc)" --target llama llama-bench llama-batched-bench >/dev/null
    ls -la "$CHECK/build/bin"
    rm -rf "$CHECK"
fi

total=$(du -sm "$CARRY" | cut -f1)
du -sh "$CARRY"/wheels "$SDIST" "$CARRY/model-skeletons"
echo "== $CARRY: $total MiB (limit $LIMIT_MIB)"
if (( total > LIMIT_MIB )); then
    echo "too large to travel: strip more" >&2
    exit 1
fi
