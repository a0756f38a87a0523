"""Which compiled variant runs: the best of avx512 / avx2 / scalar that this CPU supports and that
was built, or none (the PyTorch reference path). TOKENMILL_NATIVE=0 turns the compiled core off;
TOKENMILL_NATIVE=avx2 (or scalar) asks for a lesser variant, e.g. to measure an AVX2-only machine's
kernels on an AVX-512 one. Tests pin a variant with `use_variant`.

On CPUs with AMX-INT8 the avx512 variant's qmatmul takes tiles for whole groups of 16 rows (bitwise the
same results as its VNNI kernel); TOKENMILL_AMX=0 keeps it on VNNI, and `use_amx` switches it in tests
and benchmarks."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from types import ModuleType
from typing import Iterator

import torch

log = logging.getLogger("tokenmill.kernels")

VARIANTS = ("avx512", "avx2", "scalar")  # best first
# What each variant's module was compiled with (setup.py); the CPU must have all of it.
REQUIRED_FEATURES = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "scalar": (),
}


def _import(variant: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"tokenmill._native_{variant}")
    except ImportError:
        return None


def _features() -> dict[str, bool]:
    scalar = _import("scalar")  # the portable build asks the CPU without using what it asks about
    return dict(scalar.cpu_features()) if scalar is not None else {}


def runnable_variants() -> list[str]:
    """Variants that were built and that this CPU can run, best first."""
    features = _features()
    return [v for v in VARIANTS if all(features.get(f) for f in REQUIRED_FEATURES[v]) and _import(v) is not None]


def _off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("0", "false", "off", "no")


def _choose() -> tuple[ModuleType | None, str]:
    wanted = os.environ.get("TOKENMILL_NATIVE", "").strip().lower()
    if _off("TOKENMILL_NATIVE"):
        return None, "TOKENMILL_NATIVE=0"
    runnable = runnable_variants()
    if not runnable:
        return None, "the extension was not built (no compiler at install time?)"
    if wanted and wanted not in ("1", "true", "on", "yes", "auto"):
        if wanted not in runnable:
            return None, f"TOKENMILL_NATIVE={wanted} is not a variant this CPU can run ({', '.join(runnable)})"
        return _import(wanted), ""
    return _import(runnable[0]), ""


def _configure_amx() -> None:
    """Each module holds its own AMX switch; only an avx512 build on an AMX CPU can turn it on."""
    for v in VARIANTS:
        mod = _import(v)
        if mod is not None:
            mod.set_amx(not _off("TOKENMILL_AMX"))


_module, _why_not = _choose()
_configure_amx()
if _module is None:
    log.warning("native kernels off (%s): running on the PyTorch reference path", _why_not)
else:
    log.info("native kernels: %s variant", _module.variant)


def module() -> ModuleType | None:
    """The active variant's extension module, or None on the PyTorch path."""
    return _module


def for_rows(x: "torch.Tensor", max_cols: int = 1 << 62) -> ModuleType | None:
    """The active module when x is what the row kernels (sampling, logprobs) read: float32 [rows, cols]
    on the CPU with a unit inner stride and 1 <= cols < max_cols; else None, and the caller takes its
    torch reference."""
    if (_module is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1
            or not 0 < x.shape[1] < max_cols or x.device.type != "cpu"):
        return None
    return _module


def variant() -> str:
    """'avx512', 'avx2', 'scalar', or 'torch' when the compiled core is off."""
    return _module.variant if _module is not None else "torch"


def amx() -> bool:
    """Whether the running variant's qmatmul takes AMX-INT8 tiles."""
    return _module is not None and bool(_module.amx())


def describe() -> str:
    """One line for --version, /api/version and /health: the variant and the CPU flags it relies on."""
    if _module is None:
        return f"torch (native kernels off: {_why_not})"
    features = sorted(f for f, on in _module.cpu_features().items() if on)
    kernel = f"{_module.variant}+amx" if amx() else _module.variant
    return f"{kernel} ({_module.num_threads()} threads; cpu: {' '.join(features) or 'no SIMD flags read'})"


def set_num_threads(n: int) -> None:
    """Threads the compiled kernels use (the engine passes torch's count, i.e. --threads). Each
    variant's module has its own thread pool (csrc/thread_pool.h), started on its first parallel
    region, so setting a count starts no threads."""
    for v in VARIANTS:
        mod = _import(v)
        if mod is not None:
            mod.set_num_threads(max(1, n))


def pool_stats() -> dict[str, int] | None:
    """The active module's thread pool counters since process start or reset_pool_stats(): regions
    (parallel regions on more than one thread, one synchronisation each), inline (parallel calls run
    on the calling thread alone), join_wait_ns, worker_sleeps, threads (the pool's, workers + caller)
    and omp_regions (0: the compiled core has no OpenMP). None on the PyTorch path."""
    return dict(_module.pool_stats()) if _module is not None else None


def reset_pool_stats() -> None:
    """Zero the active module's pool counters (threads is the pool's size, not a counter)."""
    if _module is not None:
        _module.reset_pool_stats()


@contextlib.contextmanager
def use_variant(name: str | None) -> Iterator[None]:
    """Run the body on one variant ('torch' or None = the reference path); for tests and benchmarks."""
    global _module
    saved = _module
    _module = None if name in (None, "torch") else _import(name)
    if name not in (None, "torch") and _module is None:
        _module = saved
        raise ValueError(f"native variant {name!r} is not built")
    try:
        yield
    finally:
        _module = saved


@contextlib.contextmanager
def use_amx(on: bool) -> Iterator[bool]:
    """Run the body with the AMX qmatmul on or off (yields whether it is on: only where the CPU has
    it); for tests and benchmarks."""
    mod = _module
    if mod is None:
        yield False
        return
    saved = bool(mod.amx())
    try:
        yield bool(mod.set_amx(on))
    finally:
        mod.set_amx(saved)


set_num_threads(torch.get_num_threads())
