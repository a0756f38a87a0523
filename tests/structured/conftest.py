from __future__ import annotations

import pytest

from tokenmill.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_file(tiny_gguf)
