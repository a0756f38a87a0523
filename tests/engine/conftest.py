from __future__ import annotations

import pytest
import torch

from tokenmill.model import load_model


@pytest.fixture(scope="session")
def loaded(tiny_gguf):
    """The tiny random model in fp32, loaded once for all engine tests (engines never modify it)."""
    return load_model(tiny_gguf, torch.float32)
