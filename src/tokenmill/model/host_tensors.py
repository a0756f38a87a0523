"""Small CPU tensors of a step's inputs (token ids, positions, slots, block tables, the sampler's
per-row settings) from Python lists. torch.tensor(list) looks at every element to infer the type and
costs 3-8 us a call even for a few values; numpy's conversion with the type given costs a fifth of
that, and a decode step builds about seven such tensors, a sampled one a dozen more (on a 2-core box,
single stream: ~30 us of a 3 ms step, and several times that right after the step has streamed the
weights through the caches)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_TYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
                torch.bool: np.bool_}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on the CPU, values a (nested) sequence of Python numbers;
    through numpy for the types it has (torch.tensor for the others: bf16, f16)."""
    np_type = _NUMPY_TYPES.get(dtype)
    if np_type is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_type))

