"""tokenmill/gpu_info.py: what `tokenmill --version` says about GPUs, with torch.cuda played by fakes,
and that it asks CUDA nothing it does not need (no device's properties when none is counted, nothing
at all without a CUDA build)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill import gpu_info
from tokenmill.cli import main


class Untouchable:
    """torch.cuda functions that must not be called."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"torch.cuda.{name} called")
        return call


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA 13.0 build of torch, its devices set by the test."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    devices: list[SimpleNamespace] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: devices[i])
    return devices


def test_without_a_cuda_build_nothing_is_asked(monkeypatch):
    guard = Untouchable()
    monkeypatch.setattr(torch.version, "cuda", None)
    for name in ("device_count", "get_device_properties", "is_available", "init", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, guard(name))
    assert gpu_info.describe_gpus() == f"no CUDA device (torch {torch.__version__} is built without CUDA)"
    assert gpu_info.visible_gpus() == []
    assert guard.calls == []


def test_a_cuda_build_without_a_device_reads_no_properties(cuda_build, monkeypatch):
    guard = Untouchable()
    monkeypatch.setattr(torch.cuda, "get_device_properties", guard("get_device_properties"))
    assert gpu_info.describe_gpus() == f"no CUDA device (torch {torch.__version__}, CUDA 13.0: none visible)"
    assert guard.calls == []


def test_the_gpus_are_named(cuda_build):
    cuda_build += [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984),
                   SimpleNamespace(name="NVIDIA H200", total_memory=150_122_250_240)]
    assert gpu_info.visible_gpus()[1] == gpu_info.GPU(1, "NVIDIA H200", 150_122_250_240)
    assert gpu_info.describe_gpus() == ("cuda:0 NVIDIA H100 80GB HBM3 (79.6 GiB), cuda:1 NVIDIA H200 (139.8 GiB); "
                                        f"CUDA 13.0, torch {torch.__version__}")


def test_a_broken_driver_is_reported_not_raised(cuda_build, monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert "CUDA driver initialization failed" in gpu_info.describe_gpus()


def test_version_names_the_gpu(cuda_build, capsys):
    cuda_build.append(SimpleNamespace(name="NVIDIA H200", total_memory=150_122_250_240))
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert "\ncuda: cuda:0 NVIDIA H200 (139.8 GiB); CUDA 13.0" in capsys.readouterr().out


def test_version_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "\ncuda: no CUDA device (" in capsys.readouterr().out


def test_device_memory_and_labels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30, 80))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 7)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    m = gpu_info.device_memory("cuda:0")
    assert (m.free_bytes, m.total_bytes, m.used_bytes, m.allocated_bytes, m.reserved_bytes) == (30, 80, 50, 7, 9)
    assert gpu_info.device_label(torch.device("cuda")) == "cuda:2"
    assert gpu_info.device_label(torch.device("cuda", 1)) == "cuda:1"
    assert gpu_info.device_label(torch.device("cpu")) == "cpu"


def test_release_cached_memory_leaves_an_uninitialized_cuda_alone(monkeypatch):
    guard = Untouchable()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", guard("empty_cache"))
    gpu_info.release_cached_memory()
    assert guard.calls == []
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    gpu_info.release_cached_memory()
    assert emptied == [1]
