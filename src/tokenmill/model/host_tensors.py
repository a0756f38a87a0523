"""Small CPU tensors of a step's inputs (token ids, positions, slots, block tables) from Python lists.
torch.tensor(list) looks at every element to infer the type and costs 3-8 us a call even for a few
values; numpy's conversion with the type given costs a fifth of that, and a decode step builds about
seven such tensors (on a 2-core box, single stream: ~30 us of a 3 ms step)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def int64_tensor(values: Sequence) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.int64), values a (nested) sequence of ints."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def int32_tensor(values: Sequence) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.int32), values a (nested) sequence of ints."""
    return torch.from_numpy(np.array(values, dtype=np.int32))
