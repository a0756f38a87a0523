"""A tiny SentencePiece-style vocabulary laid out like Gemma's, as the GGUF tokenizer metadata
llama.cpp's converter writes for it (tokenizer.ggml.model="llama"), so tests can build Gemma-style
tokenizers and models without the 262k-token real one."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6

# Gemma's first ids, in Gemma's order: pad=0, eos=1, bos=2, unk=3, mask=4.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]

# Gemma marks its newline and tab runs, runs of 2+ spaces (stored as real spaces) and a few markup
# tokens user-defined: they are matched whole in the text.
USER_DEFINED_TOKENS = ["\n", "\n\n", "\t", "\t\t", "  ", "   ", "<table>"]

# Single characters, then merged pieces. Each merged piece splits into two earlier tokens, and the
# position in the file is its merge rank (Gemma's files list no merges). Characters missing here
# (most of Unicode) fall back to their UTF-8 bytes.
PIECES = [
    "▁", "e", "t", "a", "o", "i", "n", "h", "l", "r", "s", "d", "c", "f", "w", "u", "m", "p", "y", "x", "b", "g",
    "H", "W", "T", "I", ",", ".", "!", "?", "'", ":", "(", ")", "=", "#", "<", ">", "|", "_", "1", "2", "3",
    "é", "ï", "日", "本", "語",
    "▁t", "he", "▁th", "▁the", "in", "er", "▁a", "on", "ll", "hel", "hell", "hello", "He", "Hel", "Hell",
    "Hello", "▁w", "or", "▁wor", "ld", "▁world", "▁c", "af", "▁caf", "▁café", "日本", "▁i", "▁in", "12", "▁1",
    "▁▁▁▁", "in▁", "de", "def",
]


def tiny_spm_metadata() -> dict[str, object]:
    """The `tokenizer.ggml.*` metadata of a tiny Gemma-style SentencePiece vocabulary (no chat
    template: Gemma files carry none). Add general.architecture="gemma3" to make it a Gemma 3 file."""
    tokens = [*SPECIAL_TOKENS, *USER_DEFINED_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    types = ([CONTROL] * len(SPECIAL_TOKENS) + [USER_DEFINED] * len(USER_DEFINED_TOKENS) + [BYTE] * 256
             + [NORMAL] * len(PIECES))
    # As in Gemma's files: -1000 for control and user-defined tokens, 0 for bytes, and falling scores
    # for the pieces, best first.
    scores = ([-1000.0] * (len(SPECIAL_TOKENS) + len(USER_DEFINED_TOKENS)) + [0.0] * 256
              + [-float(i) for i in range(len(PIECES))])
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }


def add_metadata(writer: gguf.GGUFWriter, metadata: Mapping[str, object]) -> None:
    """Write metadata with the value types llama.cpp uses: ids as uint32, flags as bool, token types
    as int32 and scores as float32 arrays."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)  # typed by the first element: str, int32 or float32
        else:
            raise TypeError(f"cannot write {key}={value!r}")


def write_tokenizer_gguf(path: Path | str, metadata: Mapping[str, object] | None = None, *,
                         arch: str = "gemma3") -> Path:
    """A GGUF holding only tokenizer metadata (no tensors), which is all a tokenizer needs."""
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, tiny_spm_metadata() if metadata is None else metadata)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
