"""The compiled core's thread pool (csrc/thread_pool.h): kernels give the same bits at any thread
count (more threads than cores included), its counters count what happened, two Python threads can
run kernels at once, a forked child gets a working pool, and the pool itself holds up on its own
(a C++ harness: nested regions, concurrent callers, resizing, exceptions, fork)."""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import threading
from pathlib import Path

import gguf
import pytest
import torch

from test_qmatmul import random_gguf
from tokenmill.kernels import native
from tokenmill.kernels.qmatmul import QuantizedWeight, qmatmul

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(native.module() is None, reason="native kernels not built")


@pytest.fixture
def threads():
    """Set the native thread count inside a test; torch's count is restored after."""
    yield native.set_num_threads
    native.set_num_threads(torch.get_num_threads())


def _weight(n: int = 1000, k: int = 256, seed: int = 0) -> QuantizedWeight:
    return QuantizedWeight.from_gguf(random_gguf(Q.Q8_0, n, k, seed), Q.Q8_0, (n, k))


def test_qmatmul_is_bitwise_the_same_at_1_to_4_threads(threads):
    w = _weight()
    x = torch.randn(9, w.in_features, generator=torch.Generator().manual_seed(1))
    results = []
    for n in (1, 2, 3, 4):
        threads(n)
        results.append(qmatmul(x, w))
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_stats_count_regions_and_inline_calls(threads):
    w = _weight()
    x = torch.randn(4, w.in_features)
    stats = native.pool_stats()
    assert set(stats) == {"regions", "inline", "join_wait_ns", "worker_sleeps", "threads", "omp_regions"}
    assert all(isinstance(v, int) for v in stats.values())

    threads(1)
    native.reset_pool_stats()
    qmatmul(x, w)
    one = native.pool_stats()
    assert one["regions"] == 0 and one["inline"] >= 1  # quantize + matmul, each on the caller alone

    threads(3)
    native.reset_pool_stats()
    for _ in range(5):
        qmatmul(x, w)
    three = native.pool_stats()
    assert three["regions"] >= 5  # the matmul's 63 tiles are enough work for 3 threads
    assert three["threads"] == 3 and three["omp_regions"] == 0
    assert three["join_wait_ns"] >= 0 and three["worker_sleeps"] >= 0

    native.reset_pool_stats()
    after = native.pool_stats()
    # A worker still spinning after the last region falls asleep whenever its spin ends, which may be after
    # the reset: with no region since, each of the 2 workers can have slept once at most.
    assert after["worker_sleeps"] <= 2
    assert {k: v for k, v in after.items() if k not in ("threads", "worker_sleeps")} == {
        "regions": 0, "inline": 0, "join_wait_ns": 0, "omp_regions": 0}


def test_idle_workers_go_to_sleep(threads):
    threads(2)
    w = _weight()
    x = torch.randn(4, w.in_features)
    qmatmul(x, w)  # starts the pool
    native.reset_pool_stats()
    qmatmul(x, w)
    deadline = threading.Event()
    deadline.wait(0.05)  # far past the spin time (TOKENMILL_SPIN_US, 50 us by default)
    qmatmul(x, w)
    assert native.pool_stats()["worker_sleeps"] >= 1


def test_two_python_threads_run_kernels_at_once(threads):
    threads(2)
    weights = [_weight(seed=1), _weight(n=700, k=512, seed=2)]
    inputs = [torch.randn(5, w.in_features) for w in weights]
    expected = [qmatmul(x, w) for x, w in zip(inputs, weights)]
    failures: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(qmatmul(inputs[i], weights[i]), expected[i]):
                failures.append(f"thread {i}")
                return

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers), "a kernel call hung"
    assert failures == []


def test_a_forked_child_gets_a_working_pool(threads):
    threads(4)
    w = _weight()
    x = torch.randn(6, w.in_features)
    expected = qmatmul(x, w)  # the parent's pool is running now
    assert native.pool_stats()["threads"] == 4
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only os._exit
        try:
            os.close(read_end)
            got = qmatmul(x, w)
            ok = torch.equal(got, expected) and native.pool_stats()["threads"] == 4
            os.write(write_end, b"same" if ok else b"differs")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        answer = os.read(read_end, 16) if ready else b"hung"
    finally:
        os.close(read_end)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert answer == b"same"
    assert torch.equal(qmatmul(x, w), expected)  # and the parent's pool still works


def _harness(tmp_path: Path, *flags: str) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "thread_pool_stress"
    build = subprocess.run([compiler, "-std=c++17", "-pthread", *flags, f"-I{ROOT / 'csrc'}",
                            str(Path(__file__).with_name("thread_pool_stress.cpp")), str(ROOT / "csrc" / "thread_pool.cpp"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "-fsanitize=thread" in flags:
        pytest.skip(f"ThreadSanitizer unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    return exe


def test_the_pool_on_its_own(tmp_path):
    run = subprocess.run([str(_harness(tmp_path, "-O2"))], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == [w for c in ("ranges", "regions", "nested", "concurrent", "resize", "exception", "fork")
                                  for w in ("ok", c)]


@pytest.mark.slow
def test_the_pool_under_thread_sanitizer(tmp_path):
    run = subprocess.run([str(_harness(tmp_path, "-O1", "-g", "-fsanitize=thread")), "nofork"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "WARNING: ThreadSanitizer" not in run.stderr, run.stdout + run.stderr
