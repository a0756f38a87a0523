"""The default thread count (physical cores within the affinity mask and the cgroup quota), read from
a fake /sys and /proc under tmp_path, and configure_threads' process-wide policy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import cpu_threads
from tokenmill.cpu_threads import ThreadChoice, cgroup_cpu_limit, default_threads, parse_cpu_list, physical_cores
from tokenmill.kernels import native

V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_topology(root: Path, cores: int, smt: int = 1, packages: int = 1) -> None:
    """cores x packages physical cores, smt logical CPUs each, numbered as Linux does (siblings last)."""
    logical = cores * packages
    for pkg in range(packages):
        for core in range(cores):
            siblings = [pkg * cores + core + t * logical for t in range(smt)]
            for cpu in siblings:
                t = f"sys/devices/system/cpu/cpu{cpu}/topology"
                write(root, f"{t}/core_id", f"{core}\n")  # core ids repeat across packages
                write(root, f"{t}/physical_package_id", f"{pkg}\n")
                write(root, f"{t}/thread_siblings_list", ",".join(map(str, siblings)) + "\n")


def cgroup_v2(root: Path, path: str, limits: dict[str, str]) -> None:
    """The process in cgroup `path`; limits maps a cgroup path to its cpu.max text."""
    write(root, "proc/self/cgroup", f"0::{path}\n")
    write(root, "proc/self/mountinfo", V2_MOUNT)
    for where, text in limits.items():
        write(root, f"sys/fs/cgroup{where.rstrip('/')}/cpu.max", text)


@pytest.fixture(autouse=True)
def fresh_choice():
    saved = torch.get_num_threads()
    native_saved = native.module().num_threads() if native.module() is not None else None
    cpu_threads._reset_for_tests()
    yield
    cpu_threads._reset_for_tests()
    torch.set_num_threads(saved)
    if native_saved is not None:
        native.set_num_threads(native_saved)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def test_smt_siblings_count_once(tmp_path):
    fake_topology(tmp_path, cores=8, smt=2)
    assert physical_cores(range(16), str(tmp_path)) == 8
    choice = default_threads(str(tmp_path), cpus=range(16))
    assert choice.count == 8
    assert choice.reason == "8 physical cores in affinity (16 logical)"


def test_core_ids_repeat_across_packages(tmp_path):
    fake_topology(tmp_path, cores=4, smt=2, packages=2)
    assert physical_cores(range(16), str(tmp_path)) == 8


def test_restricted_affinity(tmp_path, monkeypatch):
    fake_topology(tmp_path, cores=8, smt=2)
    # taskset -c 0,8,1,9,2: three cores (0 and 8, 1 and 9 are siblings)
    assert default_threads(str(tmp_path), cpus={0, 8, 1, 9, 2}).count == 3
    # the process's own mask when none is given
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {3, 11, 4})
    choice = default_threads(str(tmp_path))
    assert choice.count == 2 and "(3 logical)" in choice.reason


def test_missing_topology_counts_each_cpu(tmp_path):
    assert default_threads(str(tmp_path), cpus=range(6)) == ThreadChoice(6, "6 physical cores in affinity (6 logical)")


def test_core_id_without_siblings_list(tmp_path):
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/topology/core_id", str(core))
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", "0")
    assert physical_cores(range(4), str(tmp_path)) == 2


def test_hybrid_cpu_counts_performance_cores(tmp_path):
    # 4 P-cores with SMT (CPUs 0-7, siblings 2k and 2k+1) and 8 E-cores (8-15)
    for cpu in range(16):
        siblings = f"{cpu & ~1},{cpu | 1}" if cpu < 8 else str(cpu)
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", siblings)
    write(tmp_path, "sys/devices/cpu_core/cpus", "0-7\n")
    choice = default_threads(str(tmp_path), cpus=range(16))
    assert choice == ThreadChoice(4, "4 performance cores in affinity (16 logical)")
    # pinned to E-cores only: those are what there is
    assert default_threads(str(tmp_path), cpus=range(8, 12)).count == 4


def test_cgroup_v2_quota(tmp_path):
    fake_topology(tmp_path, cores=16)
    cgroup_v2(tmp_path, "/kubepods/pod1/ctr", {"/kubepods/pod1/ctr": "400000 100000\n"})
    assert cgroup_cpu_limit(str(tmp_path)) == 4.0
    choice = default_threads(str(tmp_path), cpus=range(16))
    assert choice == ThreadChoice(4, "16 physical cores in affinity (16 logical), cgroup quota 4 CPUs -> 4")


def test_cgroup_v2_max_is_no_limit(tmp_path):
    fake_topology(tmp_path, cores=4)
    cgroup_v2(tmp_path, "/user.slice", {"/user.slice": "max 100000\n", "/": "max 100000\n"})
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert default_threads(str(tmp_path), cpus=range(4)).reason == "4 physical cores in affinity (4 logical)"


def test_cgroup_v2_nested_smallest_wins(tmp_path):
    fake_topology(tmp_path, cores=16)
    cgroup_v2(tmp_path, "/a/b/c", {"/a": "200000 100000", "/a/b": "max 100000", "/a/b/c": "600000 100000"})
    assert cgroup_cpu_limit(str(tmp_path)) == 2.0
    assert default_threads(str(tmp_path), cpus=range(16)).count == 2


@pytest.mark.parametrize(("cpu_max", "threads"), [("150000 100000", 1), ("250000 100000", 2),
                                                  ("50000 100000", 1), ("399999 100000", 3)])
def test_fractional_quota_rounds_down_to_at_least_one(tmp_path, cpu_max, threads):
    fake_topology(tmp_path, cores=8)
    cgroup_v2(tmp_path, "/ctr", {"/ctr": cpu_max})
    choice = default_threads(str(tmp_path), cpus=range(8))
    assert choice.count == threads
    assert f"cgroup quota {int(cpu_max.split()[0]) / 100000:g} CPUs -> {threads}" in choice.reason


def test_quota_above_the_cores_does_not_bind(tmp_path):
    fake_topology(tmp_path, cores=2)
    cgroup_v2(tmp_path, "/ctr", {"/ctr": "800000 100000"})
    assert default_threads(str(tmp_path), cpus=range(2)) == ThreadChoice(
        2, "2 physical cores in affinity (2 logical), cgroup quota 8 CPUs")


def test_cgroup_namespace_mount_root(tmp_path):
    # Without a cgroup namespace the container sees the host's path, and its own cgroup mounted at /sys/fs/cgroup
    write(tmp_path, "proc/self/cgroup", "0::/docker/abc\n")
    write(tmp_path, "proc/self/mountinfo", "30 25 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "300000 100000")
    assert cgroup_cpu_limit(str(tmp_path)) == 3.0
    # a path outside the mount's root: only the mount point is read
    write(tmp_path, "proc/self/cgroup", "0::/../../elsewhere\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 3.0


def test_mount_point_with_escaped_space(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/x\n")
    write(tmp_path, "proc/self/mountinfo", "30 25 0:26 / /my\\040cgroups rw - cgroup2 cgroup2 rw\n")
    write(tmp_path, "my cgroups/x/cpu.max", "100000 100000")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.0


def test_cgroup_v1_quota(tmp_path):
    fake_topology(tmp_path, cores=8)
    write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ") + V1_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 2.5
    assert default_threads(str(tmp_path), cpus=range(8)).count == 2


def test_cgroup_v1_no_quota(tmp_path):
    write(tmp_path, "proc/self/cgroup", "3:cpu,cpuacct:/\n")
    write(tmp_path, "proc/self/mountinfo", V1_MOUNT)
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None


def test_without_mountinfo_the_usual_places_are_read(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/ctr\n")
    write(tmp_path, "sys/fs/cgroup/ctr/cpu.max", "200000 100000")
    assert cgroup_cpu_limit(str(tmp_path)) == 2.0


@pytest.mark.parametrize("text", ["", "garbage", "abc 100000", "100000 0", "0 100000"])
def test_unreadable_cpu_max_is_no_limit(tmp_path, text):
    cgroup_v2(tmp_path, "/ctr", {"/ctr": text})
    assert cgroup_cpu_limit(str(tmp_path)) is None


def test_nothing_readable_falls_back_cleanly(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert default_threads(str(tmp_path), cpus={0, 1, 2}).count == 3
    assert default_threads(str(tmp_path), cpus=set()).count == 1


def test_this_machine():
    choice = default_threads()
    assert 1 <= choice.count <= len(cpu_threads.affinity_cpus())
    assert "physical cores" in choice.reason or "performance cores" in choice.reason


# --- configure_threads -----------------------------------------------------------------------------

def test_explicit_threads_override_the_default():
    choice = cpu_threads.configure_threads(3)
    assert choice.count == 3 and choice.explicit
    assert choice.reason.startswith("threads=3 requested (the default here: ")
    assert cpu_threads.current_threads() == choice
    if native.module() is not None:
        assert native.module().num_threads() == 3


def test_auto_applies_the_default():
    choice = cpu_threads.configure_threads(0)
    assert choice == default_threads()
    assert cpu_threads.current_threads() == choice
    if native.module() is not None:
        assert native.module().num_threads() == choice.count
    assert cpu_threads.configure_threads(0) == choice  # idempotent


def test_auto_never_overrides_an_explicit_count():
    cpu_threads.configure_threads(3)
    assert cpu_threads.configure_threads(0).count == 3  # a model loaded on demand keeps --threads
    assert cpu_threads.configure_threads(1).count == 1  # the last explicit count wins
    assert cpu_threads.configure_threads(0).count == 1


def test_negative_threads_rejected():
    with pytest.raises(ValueError, match="threads must be 0"):
        cpu_threads.configure_threads(-1)


@pytest.mark.skipif(native.module() is None, reason="the compiled core is not built")
def test_torch_gets_one_thread_while_engines_run_natively():
    cpu_threads.configure_threads(3)
    assert torch.get_num_threads() == 3  # no engine has said: torch keeps the count
    cpu_threads.configure_threads(3, torch_computes=False)
    assert torch.get_num_threads() == 1 and native.module().num_threads() == 3
    # an engine that runs its step in torch: torch gets the count, and keeps it
    cpu_threads.configure_threads(0, torch_computes=True)
    assert torch.get_num_threads() == 3
    cpu_threads.configure_threads(0, torch_computes=False)
    assert torch.get_num_threads() == 3


def test_torch_keeps_the_count_on_the_reference_path():
    with native.use_variant("torch"):
        cpu_threads.configure_threads(3, torch_computes=False)
        assert torch.get_num_threads() == 3


@pytest.mark.skipif(native.module() is None, reason="the compiled core is not built")
def test_torch_does_the_work_lends_the_count():
    cpu_threads.configure_threads(2, torch_computes=False)
    with cpu_threads.torch_does_the_work():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_describe():
    assert cpu_threads.describe().endswith(default_threads().reason)
    assert "not applied yet" in cpu_threads.describe()
    cpu_threads.configure_threads(2)
    assert cpu_threads.describe().startswith("2: threads=2 requested")


def test_a_forked_child_can_configure_while_the_parent_holds_the_lock():
    import os
    import time

    with cpu_threads._lock:  # as another thread of the parent would, mid-configure
        pid = os.fork()
        if pid == 0:  # the child: configure, and say so by the exit code
            code = 2
            try:
                code = 0 if cpu_threads.configure_threads(1).count == 1 else 1
            finally:
                os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung on the inherited lock")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(native.module() is None, reason="the compiled core is not built")
def test_torch_share_reaches_threads_started_later_whatever_the_configuring_thread_held():
    import threading

    seen = {}
    torch.set_num_threads(2)  # this thread's own count: configure must not take it for the process's
    worker = threading.Thread(target=lambda: cpu_threads.configure_threads(2, torch_computes=False))
    worker.start()
    worker.join()
    cpu_threads.configure_threads(2, torch_computes=True)  # from this thread, which still says 2
    later = threading.Thread(target=lambda: seen.update(n=torch.get_num_threads()))
    later.start()
    later.join()
    assert seen["n"] == 2 and cpu_threads.torch_threads() == 2
    # and the share reported is the process's, not the asking thread's
    worker = threading.Thread(target=lambda: cpu_threads.configure_threads(0))
    worker.start()
    worker.join()
    assert cpu_threads.torch_threads() == 2
