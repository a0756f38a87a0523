"""Which device a model runs on: the one place where "auto" becomes cpu or cuda."""
from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(ValueError):
    """The device asked for cannot be used here; the message says why."""


def resolve_device(name: str | torch.device) -> torch.device:
    """auto: cuda when torch sees a GPU, else cpu; cuda without one is an error, not a silent CPU run."""
    if isinstance(name, torch.device):
        return name
    if name not in DEVICES:
        raise DeviceUnavailable(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise DeviceUnavailable(f"device cuda asked for, but {why} (torch {torch.__version__})")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """What to call the device in logs and reports: the GPU's name, or 'cpu'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
