"""This process's resource use, read where the OS keeps it: for /metrics (under Prometheus' standard
process_* names, as its client libraries export them) and for the benchmarks' peak RSS.

On Linux everything comes from /proc/self; elsewhere only what `os` and `resource` give (CPU time and
peak RSS), and the rest is None."""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc/self")


@dataclass(frozen=True)
class ProcessStats:
    cpu_seconds: float                # user + system, all threads
    peak_resident_bytes: int          # the most resident memory the process has held
    resident_bytes: int | None        # now
    virtual_bytes: int | None
    open_fds: int | None
    max_fds: int | None               # the soft limit
    start_time: float | None          # Unix seconds


def _status_bytes() -> dict[str, int]:
    """The kB fields of /proc/self/status (VmRSS, VmHWM, VmSize, ...), in bytes; empty off Linux."""
    out: dict[str, int] = {}
    try:
        for line in (_PROC / "status").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


_peak_seen = 0


def peak_rss_bytes(status: dict[str, int] | None = None) -> int:
    """The peak resident set size. On Linux VmHWM, because ru_maxrss survives exec: a spawned child
    would report its parent's peak. Elsewhere ru_maxrss (KiB on Linux, bytes on macOS).

    Never below an earlier answer: the kernel counts resident pages in per-thread batches, so its
    figure can read a little lower than it did before (VmHWM read 64 KB less after a 64 MB buffer was
    freed than while it was held)."""
    global _peak_seen
    status = _status_bytes() if status is None else status
    if "VmHWM" in status:
        peak = max(status["VmHWM"], status.get("VmRSS", 0))
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = int(rss if sys.platform == "darwin" else rss * 1024)
    _peak_seen = max(_peak_seen, peak)
    return _peak_seen


def _start_time() -> float | None:
    """Boot time plus the process's start in clock ticks after boot (field 22 of /proc/self/stat)."""
    try:
        stat = (_PROC / "stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # after "pid (comm) ", fields from 3 on
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _open_fds() -> int | None:
    try:
        return len(os.listdir(_PROC / "fd"))
    except OSError:
        return None


def read() -> ProcessStats:
    status = _status_bytes()
    times = os.times()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return ProcessStats(
        cpu_seconds=times.user + times.system,
        peak_resident_bytes=peak_rss_bytes(status),
        resident_bytes=status.get("VmRSS"),
        virtual_bytes=status.get("VmSize"),
        open_fds=_open_fds(),
        max_fds=None if soft == resource.RLIM_INFINITY else soft,
        start_time=_start_time(),
    )
