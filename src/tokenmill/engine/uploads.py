"""Host-built tensors for the sampler's inputs, put on the logits' device without waiting for its
queue: torch.tensor(..., device=cuda) copies synchronously, so the host would wait there for the
step's model run instead of queueing the sampler's kernels behind it."""
from __future__ import annotations

import torch

from tokenmill.model.host_tensors import host_tensor


def upload(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """A host-built tensor on device (itself on a CPU)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ids on `device` (upload)."""
    return upload(torch.device(device), host_tensor(values, torch.long))


def column(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """values as a [n, 1] column on like's device, of like's dtype unless given."""
    return upload(like.device, host_tensor(values, dtype or like.dtype)).unsqueeze(1)
