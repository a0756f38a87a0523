"""Hostile variants of a valid GGUF file, for the validator's and the blob API's tests: each one
breaks one thing a loader must not trust (a count, a length, a tensor's type, offset or size, the
architecture), by patching the valid file's bytes where gguf.GGUFReader says that field is."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf

HUGE = 2**63 - 1


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def _tensor_field(reader: gguf.GGUFReader, index: int, part: int) -> int:
    """The byte offset of part `part` of tensor `index`'s info (name length, name, n_dims, dims, type, offset)."""
    field = reader.tensors[index].field
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


def _metadata_value(reader: gguf.GGUFReader, key: str) -> int:
    """The byte offset of the scalar value of metadata `key`."""
    field = reader.fields[key]
    return field.offset + sum(int(p.nbytes) for p in field.parts[:-1])


def crafted_variants(valid: Path) -> dict[str, bytes]:
    """name -> the bytes of a file that must be refused; `valid` is a little-endian GGUF v3 file."""
    data = valid.read_bytes()
    reader = gguf.GGUFReader(valid)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    first, last = reader.tensors[0], reader.tensors[-1]
    arch = b"general.architecture" + struct.pack("<IQ", 8, 5) + b"llama"
    assert data.count(arch) == 1
    at = data.index(arch) + len(arch) - 5
    second_offset = int(reader.tensors[1].data_offset - reader.data_offset)
    return {
        "not_gguf": b"root:x:0:0:root:/root:/bin/bash\n" * 8,
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "bad_version": _patched(data, 4, "<I", 99),
        # Ollama's CVE-2026-7482: a tensor whose data starts, or runs, past the end of the file.
        "tensor_offset_past_end": _patched(data, _tensor_field(reader, 0, 5), "<Q", len(data)),
        "tensor_size_past_end": _patched(data, _tensor_field(reader, len(reader.tensors) - 1, 3), "<Q",
                                         int(last.shape[0]) * 1024),
        "tensor_offset_huge": _patched(data, _tensor_field(reader, 0, 5), "<Q", HUGE - 31),
        "misaligned_tensor": _patched(data, _tensor_field(reader, 1, 5), "<Q", second_offset + 1),
        "overlapping_tensors": _patched(data, _tensor_field(reader, 1, 5), "<Q", 0),
        "unknown_tensor_type": _patched(data, _tensor_field(reader, 0, 4), "<I", 9999),
        "too_many_dims": _patched(data, _tensor_field(reader, 0, 2), "<I", 1000),
        "huge_tensor_count": _patched(data, 8, "<Q", HUGE),
        "huge_metadata_count": _patched(data, 16, "<Q", HUGE),
        "huge_key_length": _patched(data, 24, "<Q", HUGE),
        "huge_array_count": _patched(data, tokens.offset + sum(int(p.nbytes) for p in tokens.parts[:4]), "<Q", HUGE),
        "huge_string_length": _patched(data, tokens.offset + sum(int(p.nbytes) for p in tokens.parts[:5]), "<Q",
                                       HUGE),
        "unknown_architecture": data[:at] + b"qwen9" + data[at + 5:],
        "tensor_elements_huge": _patched(data, _tensor_field(reader, 0, 3), "<Q", 2**60),
        "zero_dimension": _patched(data, _tensor_field(reader, 0, 3), "<Q", 0),
        "offset_from_first": _patched(data, _tensor_field(reader, 0, 5), "<Q", int(first.data_offset) + 10**12),
        # A sound structure whose hyperparameters a loader would divide by or allocate for.
        **{name: _patched(data, _metadata_value(reader, "llama." + key), fmt, value) for name, key, fmt, value in (
            ("zero_head_count", "attention.head_count", "<I", 0),
            ("kv_heads_above_heads", "attention.head_count_kv", "<I",
             int(reader.fields["llama.attention.head_count"].parts[-1][0]) + 1),
            ("huge_block_count", "block_count", "<I", 2**31),
            ("huge_context_length", "context_length", "<I", 2**32 - 1),
            ("huge_rope_dimension", "rope.dimension_count", "<I", 2**31),
            ("nan_norm_eps", "attention.layer_norm_rms_epsilon", "<f", float("nan")),
            ("zero_rope_base", "rope.freq_base", "<f", 0.0),
        )},
    }

