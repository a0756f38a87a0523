from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_model import TinyLlamaSpec, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf):
    """The tiny model's byte-level BPE tokenizer."""
    from tokenmill.tokenizer import Tokenizer

    return Tokenizer.from_file(tiny_gguf)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama-architecture model with a byte-level BPE tokenizer, as a GGUF file."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", TinyLlamaSpec())


def _installed_model(name: str, env: str) -> Path:
    """A real model's GGUF: the file $env points at, else the installed `name` (`make test` pulls
    it first). Missing: a skip locally, an error under CI."""
    direct = os.environ.get(env)
    if direct:
        return Path(direct)
    from tokenmill.store import resolve_model

    try:
        return resolve_model(name)
    except Exception as exc:  # noqa: BLE001 - turn a missing model into a clear skip reason
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{name} not installed ({exc}); run `tokenmill pull {name}`")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF."""
    return _installed_model("smollm2", "TOKENMILL_SMOLLM2_GGUF")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (a SentencePiece vocabulary of 262,144 tokens)."""
    return _installed_model("gemma3:270m", "TOKENMILL_GEMMA3_GGUF")


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path):
    """transformers' tokenizer for the real Gemma 3 file (the oracle; ~30 s to build, so once per run)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)
