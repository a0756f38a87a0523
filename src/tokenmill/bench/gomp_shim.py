"""Counting every OpenMP fork-join in a process, torch's included: a tiny LD_PRELOAD library, compiled
on the fly with the system's C compiler, that wraps libgomp's entry points for `#pragma omp parallel`
(GOMP_parallel and its combined parallel-loop and sections forms), counts each call and forwards it
to the real libgomp (dlsym(RTLD_NEXT)).

The parent builds it once (`build_shim`) and starts a child with `preload_env`; the child reads the
count with `read_count()` before and after what it measures. Everything here degrades to None: no
compiler, a failed compile, or a child started without the shim simply means "not counted".

Forwarding assumes one libgomp in the process. torch's wheel ships its own libgomp.so.1 and the
compiled core links the system's under the same soname, so the one loaded first (torch's) serves
both; `openmp_runtimes()` lists what is mapped so a report can say when that does not hold."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "TOKENMILL_GOMP_SHIM"  # the shim's path, set in a child that runs with it preloaded
COUNT_SYMBOL = "tokenmill_gomp_fork_joins"

# One wrapper per libgomp entry that opens a parallel region; the signatures are libgomp's (libgomp_g.h).
_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>

static atomic_ulong fork_joins;

unsigned long %(count)s(void) { return atomic_load_explicit(&fork_joins, memory_order_relaxed); }

static void *next_symbol(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) abort(); /* called by code that links libgomp, so libgomp must be there */
    return p;
}

#define COUNTED(name, params, args)                                        \
    void name params {                                                     \
        static void (*real) params;                                        \
        if (!real) real = (void (*) params)next_symbol(#name);             \
        atomic_fetch_add_explicit(&fork_joins, 1, memory_order_relaxed);   \
        real args;                                                         \
    }

typedef void (*body_fn)(void *);
COUNTED(GOMP_parallel, (body_fn f, void *d, unsigned n, unsigned fl), (f, d, n, fl))
COUNTED(GOMP_parallel_sections, (body_fn f, void *d, unsigned n, unsigned c, unsigned fl), (f, d, n, c, fl))
#define LOOP(name) COUNTED(name, (body_fn f, void *d, unsigned n, long s, long e, long i, long ch, unsigned fl), \
                           (f, d, n, s, e, i, ch, fl))
#define LOOP_RUNTIME(name) COUNTED(name, (body_fn f, void *d, unsigned n, long s, long e, long i, unsigned fl), \
                                   (f, d, n, s, e, i, fl))
LOOP(GOMP_parallel_loop_static)
LOOP(GOMP_parallel_loop_dynamic)
LOOP(GOMP_parallel_loop_guided)
LOOP(GOMP_parallel_loop_nonmonotonic_dynamic)
LOOP(GOMP_parallel_loop_nonmonotonic_guided)
LOOP_RUNTIME(GOMP_parallel_loop_runtime)
LOOP_RUNTIME(GOMP_parallel_loop_nonmonotonic_runtime)
LOOP_RUNTIME(GOMP_parallel_loop_maybe_nonmonotonic_runtime)
""" % {"count": COUNT_SYMBOL}


@dataclass(frozen=True)
class Shim:
    path: str | None  # the compiled library, or None
    reason: str       # why it is missing, or how it was built

    @property
    def available(self) -> bool:
        return self.path is not None


def build_shim(folder: str | Path, compiler: str | None = None, timeout: float = 60.0) -> Shim:
    """Compile the shim into `folder` with `compiler` (default $CC, else gcc/cc on PATH)."""
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc or not shutil.which(cc):
        return Shim(None, "no C compiler (gcc) on PATH")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    src, lib = folder / "forkjoin_count.c", folder / "forkjoin_count.so"
    src.write_text(_SOURCE)
    try:
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"],
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Shim(None, f"{cc} failed: {exc}")
    if done.returncode != 0 or not lib.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return Shim(None, f"{cc} failed: {tail[0]}")
    return Shim(str(lib), f"LD_PRELOAD shim built with {cc}")


def preload_env(shim: Shim, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the shim preloaded, or unchanged when there is none."""
    out = dict(os.environ if env is None else env)
    if shim.available:
        out["LD_PRELOAD"] = " ".join(x for x in (shim.path, out.get("LD_PRELOAD", "")) if x)
        out[ENV_VAR] = str(shim.path)
    return out


def read_count() -> int | None:
    """Fork-joins counted so far in this process, or None when it was not started with the shim."""
    path = os.environ.get(ENV_VAR)
    if not path or path not in os.environ.get("LD_PRELOAD", ""):
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded (preloaded): the same handle and the same counter
        fn = getattr(lib, COUNT_SYMBOL)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    return int(fn())


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime files mapped into this process (more than one: counts may mislead)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = ("libgomp", "libiomp", "libomp.")
    return sorted({line.split()[-1] for line in maps.splitlines()
                   if len(line.split()) >= 6 and any(n in line.split()[-1] for n in names)})
