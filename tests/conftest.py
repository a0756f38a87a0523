from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_model import TinyLlamaSpec, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama-architecture model with a byte-level BPE tokenizer, as a GGUF file."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", TinyLlamaSpec())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF. `make test` pulls it before pytest runs;
    TOKENMILL_SMOLLM2_GGUF points at a file directly."""
    direct = os.environ.get("TOKENMILL_SMOLLM2_GGUF")
    if direct:
        return Path(direct)
    from tokenmill.store import resolve_model

    try:
        return resolve_model("smollm2")
    except Exception as exc:  # noqa: BLE001 - turn a missing model into a clear skip reason
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 not installed ({exc}); run `tokenmill pull smollm2`")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (a SentencePiece vocabulary of 262,144 tokens).
    TOKENMILL_GEMMA3_GGUF points at a file directly."""
    direct = os.environ.get("TOKENMILL_GEMMA3_GGUF")
    if direct:
        return Path(direct)
    from tokenmill.store import resolve_model

    try:
        return resolve_model("gemma3:270m")
    except Exception as exc:  # noqa: BLE001 - turn a missing model into a clear skip reason
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Gemma 3 270M not installed ({exc}); run `tokenmill pull gemma3:270m`")


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path):
    """transformers' tokenizer for the real Gemma 3 file (the oracle; ~30 s to build, so once per run)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)
