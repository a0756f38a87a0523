"""How many threads the compiled core runs, chosen once for the whole process.

The default counts as llama.cpp does (`cpu_get_num_math`): physical cores, not SMT siblings, which
add nothing to int8 and float arithmetic that already keeps a core's vector units busy; on a hybrid
Intel CPU only the performance cores. Then two limits llama.cpp does not apply: the process's CPU
affinity (taskset, a cpuset cgroup, `docker --cpuset-cpus`) and a container's CPU quota (cgroup
`cpu.max`, `docker --cpus`, a Kubernetes CPU limit). A quota of 1.5 CPUs gives 1 thread, not 2: a
pool that synchronises several times per layer and asks for more CPU time than the quota grants gets
every thread of the container throttled until the next period (100 ms by default), so it collapses
rather than slows; the remainder is left to the HTTP loop and the engine's own thread.

Every reader takes `root` (default "/") so that tests fake /sys and /proc in a temporary folder.

`configure_threads` applies the choice process-wide: the compiled core's pool and torch's intra-op
pool. Where the native core runs the model step, torch only runs glue in between (the sampled rows'
gather, banned tokens' index_put, tensors made from lists: tens of microseconds a step) and gets 1
thread, so that its OpenMP team never wakes, or spins, beside the pool's workers; where torch does
the work (bf16/fp32 dense weights, TOKENMILL_NATIVE=0) it gets the count. OpenMP keeps that count per
thread, and a thread takes torch's process-wide value at its first parallel op: an engine's loop
thread starts after its engine configured threads, so it runs with that engine's share."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger("tokenmill.threads")


@dataclass(frozen=True)
class ThreadChoice:
    count: int   # threads the compiled core runs (>= 1)
    reason: str  # why, for people: "8 physical cores in affinity (16 logical), cgroup quota 4 CPUs -> 4"
    explicit: bool = False  # asked for (--threads), not the default


# --- what the machine offers -----------------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,8,10-11") as a set; ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def affinity_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], root: str = "/") -> int:
    """How many physical cores the given logical CPUs sit on: SMT siblings of one core count once.

    A core is named by its siblings list (core_cpus_list, or thread_siblings_list on older kernels),
    which is unique across packages and dies; failing that by (package, core_id); a CPU whose
    topology cannot be read counts as a core of its own."""
    topology = Path(root, "sys/devices/system/cpu")
    cores: set[object] = set()
    for cpu in cpus:
        t = topology / f"cpu{cpu}" / "topology"
        siblings = _read(t / "core_cpus_list") or _read(t / "thread_siblings_list")
        if siblings:
            try:
                cores.add(frozenset(parse_cpu_list(siblings)))
                continue
            except ValueError:
                pass
        package, core = _read(t / "physical_package_id"), _read(t / "core_id")
        cores.add(("core", package, core) if package is not None and core is not None else ("cpu", cpu))
    return len(cores)


def performance_cpus(root: str = "/") -> set[int] | None:
    """On a hybrid Intel CPU (P-cores and E-cores), the logical CPUs of the performance cores (the
    kernel's `cpu_core` PMU lists them); None on other CPUs. llama.cpp counts only these too: a
    step's threads all wait for the slowest, so E-cores would hold the P-cores back."""
    text = _read(Path(root, "sys/devices/cpu_core/cpus"))
    if not text:
        return None
    try:
        return parse_cpu_list(text) or None
    except ValueError:
        return None


# --- cgroup CPU quota ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Mount:
    root: str        # the cgroup path that the mount point shows (its "/" inside a namespace)
    point: Path      # where it is mounted, under `root` of the readers
    version: int     # 1 or 2
    controllers: frozenset[str]


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ...)
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(root: str) -> list[_Mount]:
    """cgroup mounts from /proc/self/mountinfo; without it, the usual places under /sys/fs/cgroup."""
    text = _read(Path(root, "proc/self/mountinfo"))
    if text is None:
        base = Path(root, "sys/fs/cgroup")
        return [_Mount("/", base, 2, frozenset()),
                *(_Mount("/", base / name, 1, frozenset(name.split(","))) for name in ("cpu,cpuacct", "cpu"))]
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = Path(root, _unescape(fields[4]).lstrip("/"))
        if tail[0] == "cgroup2":
            mounts.append(_Mount(_unescape(fields[3]), point, 2, frozenset()))
        else:
            mounts.append(_Mount(_unescape(fields[3]), point, 1, frozenset(tail[2].split(","))))
    return mounts


def _memberships(root: str) -> list[tuple[int, frozenset[str], str]]:
    """(version, controllers, path) for each line of /proc/self/cgroup."""
    text = _read(Path(root, "proc/self/cgroup")) or ""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        out.append((2, frozenset(), path) if controllers == "" and parts[0] == "0"
                   else (1, frozenset(controllers.split(",")), path))
    return out


def _cgroup_dirs(mount: _Mount, path: str) -> list[Path]:
    """The process's cgroup folder under a mount, then each parent up to the mount point: the kernel
    applies every ancestor's limit, so the smallest one binds. A path outside the mount's root (a
    container that sees its host's paths) leaves only the mount point itself."""
    prefix = mount.root.rstrip("/")  # "" for a mount of the whole hierarchy
    if path.rstrip("/") == prefix:
        rel = ""
    elif path.startswith(prefix + "/"):
        rel = path[len(prefix):]
    else:
        return [mount.point]
    parts = [p for p in rel.split("/") if p]
    if ".." in parts:  # a cgroup outside this namespace's view
        return [mount.point]
    dirs = [mount.point]
    for part in parts:
        dirs.append(dirs[-1] / part)
    return dirs[::-1]


def _v2_limit(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    fields = text.split()
    try:
        period = float(fields[1]) if len(fields) > 1 else 100_000.0
        return None if fields[0] == "max" or period <= 0 else float(fields[0]) / period
    except ValueError:
        return None


def _v1_limit(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """The CPUs the process's cgroup quota grants (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us`), the smallest over the cgroup and its parents; None when there is no quota
    or nothing can be read."""
    mounts = _mounts(root)
    limits: list[float] = []
    for version, controllers, path in _memberships(root):
        if version == 1 and "cpu" not in controllers:
            continue
        for mount in mounts:
            if mount.version != version or (version == 1 and "cpu" not in mount.controllers):
                continue
            reader = _v2_limit if version == 2 else _v1_limit
            limits += [x for x in map(reader, _cgroup_dirs(mount, path)) if x is not None and x > 0]
    return min(limits) if limits else None


def quota_threads(cpus: float) -> int:
    """Threads for a quota of `cpus` CPUs: rounded down (see the module's docstring), at least 1."""
    return max(1, math.floor(cpus + 1e-9))


# --- the choice ------------------------------------------------------------------------------------

def default_threads(root: str = "/", cpus: Iterable[int] | None = None) -> ThreadChoice:
    """Physical cores (performance cores on a hybrid CPU) within the CPU affinity (`cpus`, default
    this process's), capped by the cgroup CPU quota."""
    allowed = set(affinity_cpus() if cpus is None else cpus)
    logical = len(allowed)
    fast = performance_cpus(root)
    kind = "physical cores"
    if fast and (allowed & fast) and (allowed - fast):
        allowed &= fast
        kind = "performance cores"
    cores = max(1, physical_cores(sorted(allowed), root)) if allowed else 1
    reason = f"{cores} {kind} in affinity ({logical} logical)"
    count = cores
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        if quota_threads(quota) < cores:
            count = quota_threads(quota)
            reason += f", cgroup quota {quota:g} CPUs -> {count}"
        else:
            reason += f", cgroup quota {quota:g} CPUs"
    return ThreadChoice(count, reason)


# --- applying it, process-wide ---------------------------------------------------------------------

_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    # A child forked while another thread of the parent held the lock would inherit it held forever.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)

_current: ThreadChoice | None = None
_torch_applied: int | None = None  # torch's intra-op count as last set here, for the process
_torch_work: bool | None = None   # None: no engine said; True once any engine runs its step in torch


def configure_threads(requested: int, *, torch_computes: bool | None = None) -> ThreadChoice:
    """Apply a thread count process-wide (0 = `default_threads()`): the compiled core's pool and
    torch's intra-op threads. Idempotent, and shared by every engine of the process:

    - the last explicit count (requested > 0) wins; an automatic request (0) never overrides an
      explicit one, so models that a server loads on demand keep the server's --threads;
    - torch_computes says whether the caller's model step runs in torch (True) or in the native core
      (False); None leaves torch's share as it stands. Torch runs with 1 thread while every engine so
      far runs natively and the compiled core is loaded, and with the full count as soon as one
      engine of the process needs torch (kept from then on: an engine's torch work must never run on
      one thread, while glue ops of native engines on more threads only cost what they did before)."""
    global _current, _torch_work
    if requested < 0:
        raise ValueError(f"threads must be 0 (automatic) or more, got {requested}")
    with _lock:
        if requested > 0:
            auto = default_threads()
            choice = ThreadChoice(requested, f"threads={requested} requested (the default here: {auto.count}, "
                                             f"{auto.reason})", explicit=True)
        elif _current is not None and _current.explicit:
            choice = _current
        else:
            choice = default_threads()
        if torch_computes is not None:
            _torch_work = bool(_torch_work) or torch_computes
        before = (_current, _torch_applied)
        _apply(choice)
        _current = choice
        if (choice, _torch_applied) != before:
            log.info("compute threads: %d (%s); torch intra-op threads: %d", choice.count, choice.reason,
                     _torch_applied)
        return choice


def _torch_share(count: int) -> int:
    from tokenmill.kernels import native

    if native.module() is None or _torch_work is not False:
        return count
    return 1


def _apply(choice: ThreadChoice) -> None:
    import torch

    from tokenmill.kernels import native

    global _torch_applied
    native.set_num_threads(choice.count)
    # Always set: torch.get_num_threads() answers for the calling thread only (OpenMP keeps the count
    # per thread; a thread takes torch's process-wide value at its first parallel op), so it cannot
    # tell whether the process-wide value already is `share`.
    _torch_applied = _torch_share(choice.count)
    torch.set_num_threads(_torch_applied)


@contextlib.contextmanager
def torch_does_the_work() -> Iterator[None]:
    """The body runs torch's own kernels with the full count, whatever the engines' policy, and the
    policy's share is restored after it (a benchmark's transformers peer, in the process of a native
    engine). Only for code that runs while no native step does."""
    import torch

    count = (_current or default_threads()).count
    saved = torch.get_num_threads() if _torch_applied is None else _torch_applied
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def current_threads() -> ThreadChoice | None:
    """The choice applied last (None before any engine or bench configured one)."""
    return _current


def torch_threads() -> int:
    """torch's intra-op thread count as configure_threads set it for the process (torch's own answer
    before it did). Not torch.get_num_threads() afterwards: that is the calling thread's count, which a
    thread fixes at its first parallel op (the HTTP loop's may predate the engines')."""
    if _torch_applied is not None:
        return _torch_applied
    import torch

    return torch.get_num_threads()


def describe() -> str:
    """One line for --version and the startup log: the count applied, or the default if none was."""
    choice = _current or default_threads()
    applied = "" if _current else " (default; not applied yet)"
    return f"{choice.count}{applied}: {choice.reason}"


def _reset_for_tests() -> None:
    global _current, _torch_work, _torch_applied
    with _lock:
        _current, _torch_work, _torch_applied = None, None, None
