"""Shared fixtures for the tokenizer tests: our tokenizers and transformers' for the same GGUF files.

transformers is the oracle: it loads the same GGUF, and our ids, text and prompts must match its own."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from tiny_model import CHATML_TEMPLATE, tiny_vocab
from tiny_spm import write_tokenizer_gguf
from tokenmill.gguf import open_gguf
from tokenmill.tokenizer import Tokenizer

# Text that exercises every branch of the byte-level pre-tokenizers: scripts, emoji (multi-codepoint
# too), code, whitespace runs and their mix with digits, and special tokens written inside text.
CORPUS = [
    "",
    " ",
    "\n",
    "Hello world",
    "Hello, world! How's it going? I'm fine, they'd say.",
    "  leading and trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nand\r\nwindows\r\n",
    "naïve café résumé Ωμέγα Ünïcödé façade",
    "日本語のテキストです。中文文本。한국어 텍스트",
    "emoji 🙂👍🏽 🇫🇷 👨‍👩‍👧 ❤️ done",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "numbers 1 12 123 1234 12345678 3.14159 -42 1,000,000 2024-01-31",
    "x  1\n\n2.  list\t\t3",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>c<|im_start|>",
    "<|im_start|<|im_end|>|>",
    "<|not_special|> <|im_start |>",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.org",
    "mixed 文字 and ascii 🙂 and numbers ٣٤٥ and math ∑∫√π",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
    "combining e\u0301 n\u0303 a\u0308 and HTTPServer camelCase XMLHttpRequest",
    "contractions: don't I'M we'LL you'Re it's 12345 1234567",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return CORPUS


def _reference(path: Path):
    # The class AutoTokenizer picks for a GGUF; calling it directly skips AutoTokenizer's config
    # detection, which parses the whole file again and costs seconds per model.
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_file(tiny_gguf)


@pytest.fixture(scope="session")
def tiny_reference(tiny_gguf):
    return _reference(tiny_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    return _reference(smollm2_path)


@pytest.fixture(scope="session")
def reference_for() -> Callable[[Path], object]:
    return _reference


def assert_parity(ours: Tokenizer, ref, texts: list[str]) -> None:
    """Our ids and decoded text equal transformers' (`ref`), with and without specials."""
    for text in texts:
        for add_special in (True, False):
            assert ours.encode(text, add_special_tokens=add_special) == ref.encode(
                text, add_special_tokens=add_special), text
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def sentencepiece_reference(path: Path):
    """transformers' tokenizer for a SentencePiece GGUF, loaded the way users do (AutoTokenizer picks
    GemmaTokenizer for a Gemma file, with its own special-token defaults)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny_spm_path(tmp_path_factory) -> Path:
    """The tiny Gemma-style SentencePiece vocabulary of tests/tiny_spm.py, as a Gemma 3 GGUF."""
    return write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


@pytest.fixture(scope="session")
def tiny_spm_tokenizer(tiny_spm_path) -> Tokenizer:
    return Tokenizer.from_file(tiny_spm_path)


@pytest.fixture(scope="session")
def tiny_spm_reference(tiny_spm_path):
    return sentencepiece_reference(tiny_spm_path)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(gemma3_path).metadata)


@pytest.fixture(scope="session")
def make_tokenizer_gguf(tmp_path_factory) -> Callable[..., Path]:
    """Write a GGUF holding only tokenizer metadata: the tiny vocabulary plus `extra` (token, type)
    pairs and `extra_merges`, so tests can vary `pre`, token types and BOS handling."""

    def make(name: str, *, pre: str | None = "smollm", extra: tuple[tuple[str, int], ...] = (),
             extra_merges: tuple[str, ...] = (), bos_id: int | None = 1, eos_id: int = 2,
             add_bos: bool | None = False, chat_template: str | None = CHATML_TEMPLATE, **ids: int) -> Path:
        tokens, types, merges = tiny_vocab()
        tokens += [t for t, _ in extra]
        types += [k for _, k in extra]
        path = tmp_path_factory.mktemp("tok") / f"{name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges + list(extra_merges))
        if bos_id is not None:
            w.add_bos_token_id(bos_id)
        w.add_eos_token_id(eos_id)
        for key, value in ids.items():  # e.g. eot_token_id=...
            w.add_uint32(f"tokenizer.ggml.{key}", value)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
        if chat_template is not None:
            w.add_chat_template(chat_template)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    return make
