"""What the CLI and the server say about NVIDIA GPUs: the devices torch sees (`tokenmill --version`),
a device's memory (the models-on-demand budget, /metrics) and the caching allocator's share. Every
torch.cuda call of these reports is here, so tests patch one module to play a GPU.

Nothing here initializes CUDA where no model asked for it: without a CUDA build of torch nothing is
called; device_count() asks NVML where it can; a device's properties are read only when one is counted."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory as the driver (free, total: every process's use) and this process's caching
    allocator (allocated by live tensors, reserved from the driver) see it."""
    free_bytes: int
    total_bytes: int
    allocated_bytes: int
    reserved_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


def visible_gpus() -> list[GPU]:
    """The CUDA devices torch can use here; [] without a CUDA build or a visible device."""
    if torch.version.cuda is None or torch.cuda.device_count() == 0:
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GPU(i, props.name, int(props.total_memory)))
    return gpus


def describe_gpus() -> str:
    """`tokenmill --version`'s cuda line: the GPUs and the CUDA torch was built with, or why none."""
    if torch.version.cuda is None:
        return f"no CUDA device (torch {torch.__version__} is built without CUDA)"
    try:
        gpus = visible_gpus()
    except RuntimeError as exc:  # a broken driver: say so rather than fail --version
        return f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}: {exc})"
    if not gpus:
        return f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}: none visible)"
    listed = ", ".join(f"cuda:{g.index} {g.name} ({g.total_bytes / 2**30:.1f} GiB)" for g in gpus)
    return f"{listed}; CUDA {torch.version.cuda}, torch {torch.__version__}"


def device_label(device: torch.device) -> str:
    """cuda:N for a model's device (a bare "cuda" means the current one)."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index}"


def device_memory(device: torch.device | str) -> DeviceMemory:
    """A GPU's memory now. Call only for a device a model uses (it talks to the driver)."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total), int(torch.cuda.memory_allocated(device)),
                        int(torch.cuda.memory_reserved(device)))


def gpu_name(device: torch.device | str) -> str:
    return torch.cuda.get_device_name(torch.device(device))


def release_cached_memory() -> None:
    """Give the caching allocator's unused blocks back to the driver, so that what an unloaded model
    held shows as free (to the next load's budget, and to other processes). Only where CUDA is up."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
