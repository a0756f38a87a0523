"""process_stats: this process's resource use, as /metrics and the benchmarks report it."""
from __future__ import annotations

import subprocess
import sys
import time

from tokenmill import process_stats


def test_reads_this_process():
    s = process_stats.read()
    assert s.cpu_seconds > 0
    assert 0 < s.resident_bytes <= s.peak_resident_bytes <= process_stats.peak_rss_bytes()
    assert s.resident_bytes < s.virtual_bytes
    assert 3 <= s.open_fds and (s.max_fds is None or s.open_fds <= s.max_fds)
    assert 0 < time.time() - s.start_time < 24 * 3600


def test_resident_and_peak_follow_memory_touched():
    # In a fresh process: in the test process, threads of earlier tests may free memory meanwhile.
    code = """
from tokenmill import process_stats
before = process_stats.read()
block = bytearray(64 << 20)
block[::4096] = b"\\x01" * len(range(0, len(block), 4096))  # fault every page in
during = process_stats.read()
assert during.resident_bytes - before.resident_bytes >= 48 << 20, (before, during)
assert during.peak_resident_bytes >= during.resident_bytes
del block
assert process_stats.read().peak_resident_bytes >= during.peak_resident_bytes  # a peak never falls
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_open_fds_count_files_opened(tmp_path):
    before = process_stats.read().open_fds
    files = [open(tmp_path / f"f{i}", "w") for i in range(32)]
    try:
        during = process_stats.read().open_fds
    finally:
        for f in files:
            f.close()
    assert during - before >= 24  # other threads of the test process may close a few meanwhile


def test_cpu_seconds_count_work_done():
    before = process_stats.read().cpu_seconds
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    assert process_stats.read().cpu_seconds >= before + 0.08  # os.times() counts in 10 ms ticks
