"""Every Triton kernel builds for sm_90 (H100/H200) with the tile sizes it launches with, here, without
a GPU (see gpu_sm90_build.py), in a child process that does not interpret Triton."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_sm90_build.py")


def test_every_kernel_builds_for_sm90():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton install has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = [line.split()[0] for line in done.stdout.splitlines()]
    assert built.count("_decode_part_kernel") == 3 and built.count("_prefill_kernel") == 3, done.stdout
    assert {"_decode_merge_kernel", "_kv_write_kernel", "_token_bitmask_kernel"} <= set(built), done.stdout
    assert built.count("_residual_norm_kernel") == 4 and built.count("_rope_kernel") == 4, done.stdout
    assert built.count("_gated_kernel") == 2, done.stdout
