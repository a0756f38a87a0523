"""The compiled core as a user meets it: which variant runs, and the PyTorch path when it is off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill import kernels


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_native_off_runs_on_the_pytorch_path_and_says_so():
    r = _python("from tokenmill import kernels; print(kernels.variant())", TOKENMILL_NATIVE="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "torch"
    assert "native kernels off (TOKENMILL_NATIVE=0)" in r.stderr


def test_a_lesser_variant_can_be_asked_for():
    if "avx2" not in kernels.runnable_variants():
        pytest.skip("this CPU cannot run the avx2 variant")
    r = _python("from tokenmill import kernels; print(kernels.variant())", TOKENMILL_NATIVE="avx2")
    assert r.stdout.strip() == "avx2", r.stderr


def test_version_names_the_kernels():
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kernels: " + kernels.variant() in r.stdout


def test_the_best_runnable_variant_is_chosen_by_default():
    if os.environ.get("TOKENMILL_NATIVE"):
        pytest.skip("TOKENMILL_NATIVE is set for this run")
    runnable = kernels.runnable_variants()
    assert kernels.variant() == (runnable[0] if runnable else "torch")


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read().split()
    except OSError:
        return False


def test_amx_runs_where_the_cpu_has_it_and_can_be_turned_off():
    code = "from tokenmill import kernels; print(kernels.amx()); print(kernels.describe())"
    on = _python(code)
    assert on.returncode == 0, on.stderr
    expected = kernels.variant() == "avx512" and _cpu_has_amx() and not os.environ.get("TOKENMILL_AMX")
    assert on.stdout.split("\n")[0] == str(expected)
    assert ("avx512+amx" in on.stdout) == expected
    off = _python(code, TOKENMILL_AMX="0")
    assert off.stdout.split("\n")[0] == "False" and "+amx" not in off.stdout, off.stderr


@pytest.mark.parametrize("name,forbidden", [("avx2", "zmm"), ("avx2", "tmm"), ("scalar", "ymm"), ("scalar", "tmm")])
def test_each_variant_holds_only_its_own_instructions(name, forbidden):
    """A variant built with another's objects would still pass every test on this CPU, and crash on
    the CPUs it exists for."""
    import importlib
    import shutil

    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    try:
        mod = importlib.import_module(f"tokenmill._native_{name}")
    except ImportError:
        pytest.skip(f"{name} variant not built")
    listing = subprocess.run(["objdump", "-d", mod.__file__], capture_output=True, text=True, check=True).stdout
    assert f"%{forbidden}" not in listing
