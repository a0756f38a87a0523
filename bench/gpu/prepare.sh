#!/usr/bin/env bash
# Fills .carry-gpu/ (git-ignored) with what bench/gpu/check.sh needs on a GPU box with no network:
#   .carry-gpu/wheels/           cp312 manylinux x86_64 wheels of what the box lacks (requirements.txt
#                                beside this script: gguf, starlette, uvicorn, llguidance, pytest, their
#                                dependencies, pip, pybind11 and setuptools)
#   .carry-gpu/model-skeletons/  model_skeleton.py and the SmolLM2 and Gemma 3 skeletons (their shapes and
#                                tokenizers, no weights: check.sh rebuilds random-weight GGUFs from them)
#   .carry-gpu/COMMIT            the commit the check ran on (the box's copy of the tree has no .git)
# Run it here, with PyPI reachable:  bash bench/gpu/prepare.sh
# Env: PYTHON (a python with pip; default .venv/bin/python), CARRY (default .carry-gpu), SKELETONS
#      (default ../shared/model-skeletons), LIMIT_MIB (default 40: the checkout and the carried
#      folder travel together, 64 MiB at most).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CARRY=${CARRY:-$ROOT/.carry-gpu}
SKELETONS=${SKELETONS:-$ROOT/../shared/model-skeletons}
LIMIT_MIB=${LIMIT_MIB:-40}

mkdir -p "$CARRY/wheels"
echo "== wheels for cp312 manylinux x86_64 -> $CARRY/wheels"
# One by one without dependencies (they are pinned in requirements.txt too): a resolve would also
# download numpy, which the box has.
grep -Ev '^\s*(#|$)' "$HERE/requirements.txt" | while read -r req; do
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        "$req" -d "$CARRY/wheels" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done

echo "== every wheel's requirements: carried, or on the box"
"$PYTHON" - "$CARRY/wheels" <<'EOF'
import re, sys, zipfile
from pathlib import Path

ON_THE_BOX = {"numpy", "torch", "triton", "tokenizers", "jinja2", "markupsafe", "transformers", "safetensors",
              "huggingface-hub", "regex", "filelock", "fsspec"}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels = list(Path(sys.argv[1]).glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
missing = set()
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            spec = line.split(":", 1)[1].strip()
            name, _, marker = spec.partition(";")
            if "extra ==" in marker or re.search(r"python_version\s*<\s*['\"]3\.(1[01]|[0-9])['\"]", marker) \
                    or "sys_platform == \"win32\"" in marker or "platform_system == \"Windows\"" in marker:
                continue
            dep = norm(re.split(r"[\s<>=!~\[(]", name.strip())[0])
            if dep not in carried and dep not in ON_THE_BOX:
                missing.add(f"{dep} (for {w.name})")
if missing:
    sys.exit("not carried: " + ", ".join(sorted(missing)))
print(f"{len(wheels)} wheels, closed over their requirements")
EOF

echo "== model skeletons from $SKELETONS"
rm -rf "$CARRY/model-skeletons"
mkdir -p "$CARRY/model-skeletons"
cp "$SKELETONS"/model_skeleton.py "$SKELETONS"/smollm2-135m-q4_1.json "$SKELETONS"/gemma3-270m-q4_k_m.json \
    "$CARRY/model-skeletons/"
chmod u+w "$CARRY"/model-skeletons/*

git -C "$ROOT" rev-parse --short HEAD > "$CARRY/COMMIT" 2>/dev/null || echo unknown > "$CARRY/COMMIT"
if [[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    sed -i 's/$/ + uncommitted changes/' "$CARRY/COMMIT"
fi

total=$(du -sm "$CARRY" | cut -f1)
du -sh "$CARRY"/wheels "$CARRY/model-skeletons"
echo "== $CARRY: $total MiB (limit $LIMIT_MIB); commit $(cat "$CARRY/COMMIT")"
if (( total > LIMIT_MIB )); then
    echo "too large to travel" >&2
    exit 1
fi
