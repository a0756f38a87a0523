"""Hostile GGUF files built from scratch, for the tests of what a client may push as a blob: a small
but complete Llama (written with gguf.GGUFWriter) whose metadata and tensors a test may change one at
a time, and a raw writer (struct.pack) for files no writer would produce (duplicate keys, lying
counts, bogus offsets). Crafted byte patches of a valid file are in crafted_gguf.py."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tiny_model import CHATML_TEMPLATE, tiny_vocab

VT = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

# A deliberately small Llama: head size 16 (the native kernels want a multiple of 16), the file ~50 KB.
DIM, HEADS, KV_HEADS, FFN, LAYERS = 32, 2, 1, 32, 1
HEAD_DIM = DIM // HEADS

DROP = object()  # a metadata value or tensor that says: leave this one out


def llama_metadata() -> dict[str, tuple[Any, VT]]:
    """key -> (value, value type) of the small Llama, in the order written."""
    tokens, types, merges = tiny_vocab()
    return {
        "general.architecture": ("llama", VT.STRING),
        "general.name": ("hostile", VT.STRING),
        "llama.block_count": (LAYERS, VT.UINT32),
        "llama.context_length": (64, VT.UINT32),
        "llama.embedding_length": (DIM, VT.UINT32),
        "llama.feed_forward_length": (FFN, VT.UINT32),
        "llama.attention.head_count": (HEADS, VT.UINT32),
        "llama.attention.head_count_kv": (KV_HEADS, VT.UINT32),
        "llama.rope.freq_base": (10000.0, VT.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, VT.FLOAT32),
        "llama.rope.dimension_count": (HEAD_DIM, VT.UINT32),
        "llama.vocab_size": (len(tokens), VT.UINT32),
        "tokenizer.ggml.model": ("gpt2", VT.STRING),
        "tokenizer.ggml.pre": ("smollm", VT.STRING),
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY),
        "tokenizer.ggml.token_type": (types, VT.ARRAY),
        "tokenizer.ggml.merges": (merges, VT.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, VT.UINT32),
        "tokenizer.ggml.eos_token_id": (2, VT.UINT32),
        "tokenizer.chat_template": (CHATML_TEMPLATE, VT.STRING),
    }


def llama_tensors(vocab: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """name -> float32 array (PyTorch order, rows first) of the small Llama."""
    rng = np.random.default_rng(seed)
    vocab = vocab or len(tiny_vocab()[0])

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, size=(rows, cols)).astype(np.float32)

    out = {"token_embd.weight": mat(vocab, DIM)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": np.ones(DIM, np.float32),
            p + "attn_q.weight": mat(HEADS * HEAD_DIM, DIM),
            p + "attn_k.weight": mat(KV_HEADS * HEAD_DIM, DIM),
            p + "attn_v.weight": mat(KV_HEADS * HEAD_DIM, DIM),
            p + "attn_output.weight": mat(DIM, HEADS * HEAD_DIM),
            p + "ffn_norm.weight": np.ones(DIM, np.float32),
            p + "ffn_gate.weight": mat(FFN, DIM),
            p + "ffn_up.weight": mat(FFN, DIM),
            p + "ffn_down.weight": mat(DIM, FFN),
        })
    out["output_norm.weight"] = np.ones(DIM, np.float32)
    return out


def small_llama(path: Path, metadata: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None, *,
                endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> bytes:
    """The small Llama's bytes, written by gguf.GGUFWriter to `path`, with `metadata` (key -> value,
    or (value, type), or DROP) and `tensors` (name -> array, or DROP) changed."""
    meta = llama_metadata()
    for key, value in (metadata or {}).items():
        if value is DROP:
            meta.pop(key, None)
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], VT):
            meta[key] = value
        else:
            meta[key] = (value, meta[key][1] if key in meta else VT.STRING)
    arrays = llama_tensors()
    for name, value in (tensors or {}).items():
        if value is DROP:
            arrays.pop(name, None)
        else:
            arrays[name] = value
    w = gguf.GGUFWriter(str(path), meta.pop("general.architecture", ("llama", VT.STRING))[0], endianess=endianess)
    for key, (value, vtype) in meta.items():
        if vtype == VT.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, arr in arrays.items():
        w.add_tensor(name, arr if endianess == gguf.GGUFEndian.LITTLE else arr.byteswap())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path).read_bytes()


# --- the raw writer --------------------------------------------------------------------------------

def gguf_string(text: str | bytes, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def kv_string(key: str, value: str | bytes, length: int | None = None) -> bytes:
    return gguf_string(key) + struct.pack("<I", VT.STRING) + gguf_string(value, length)


def kv_u32(key: str, value: int) -> bytes:
    return gguf_string(key) + struct.pack("<II", VT.UINT32, value)


def kv_array_header(key: str, element_type: int, count: int) -> bytes:
    """An array's key, type, element type and count; its elements are the caller's to append."""
    return gguf_string(key) + struct.pack("<IIQ", VT.ARRAY, element_type, count)


def tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    """dims in GGUF order (the row length first)."""
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def raw_gguf(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", *, version: int = 3,
             kv_count: int | None = None, tensor_count: int | None = None, alignment: int = 32) -> bytes:
    """A GGUF file from encoded key/value pairs and tensor infos, the data padded to `alignment`;
    the counts in the header are the real ones unless given."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if tensor_count is None else tensor_count,
                                 len(kvs) if kv_count is None else kv_count)
    body = head + b"".join(kvs) + b"".join(infos)
    if data:
        body += b"\0" * (-len(body) % alignment) + data
    return body


def minimal_llama_kvs(architecture: str = "llama") -> list[bytes]:
    """The key/value pairs a one-tensor file needs to pass the hyperparameter checks."""
    return [kv_string("general.architecture", architecture), kv_u32("llama.block_count", 1),
            kv_u32("llama.embedding_length", 4), kv_u32("llama.feed_forward_length", 8),
            kv_u32("llama.attention.head_count", 1), kv_u32("llama.vocab_size", 2)]
