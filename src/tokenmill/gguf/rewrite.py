"""Write a copy of a GGUF file in which some tensors hold other data (and maybe another type): its
header and metadata byte for byte, the same tensors in the same order, new tensor infos and the data.
Used to store a model with its LoRA adapters merged (gguf/lora.py), so that the result is an ordinary
GGUF that every loader path (the native kernels, the GPU's, llama.cpp) reads as it is."""
from __future__ import annotations

import struct
from collections.abc import Callable, Mapping

import numpy as np

from tokenmill.gguf.lora import MergedTensor
from tokenmill.gguf.reader import GGUFError, GGUFFile

_CHUNK = 1 << 22


def write_replaced(base: GGUFFile, replaced: Mapping[str, MergedTensor], write: Callable[[bytes], object]) -> None:
    """Stream the copy of `base` with `replaced` tensors to `write` (a file's or an upload's)."""
    if base.byte_order != "<" or base.mapping is None:
        raise GGUFError("only a little-endian GGUF file can be rewritten")
    unknown = set(replaced) - set(base.tensors)
    if unknown:
        raise GGUFError(f"no tensor {sorted(unknown)[0]!r} to replace")
    align = base.alignment
    infos = bytearray()
    offset = 0
    for name, t in base.tensors.items():
        new = replaced.get(name)
        if new is not None and tuple(new.shape) != tuple(t.shape):
            raise GGUFError(f"tensor {name!r} is {tuple(t.shape)}; its replacement is {tuple(new.shape)}")
        ggml_type, nbytes = (new.ggml_type, new.nbytes) if new is not None else (t.ggml_type, t.data.nbytes)
        key = name.encode("utf-8")
        dims = tuple(reversed(t.shape))
        infos += struct.pack("<Q", len(key)) + key + struct.pack("<I", len(dims))
        infos += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", int(ggml_type), offset)
        offset += -(-nbytes // align) * align
    head = bytes(base.mapping[:base.metadata_end]) + bytes(infos)
    write(head + bytes(-len(head) % align))
    for name, t in base.tensors.items():  # a replaced tensor's data is made here, one at a time
        new = replaced.get(name)
        data = np.ascontiguousarray(new.make() if new is not None else t.data)
        if new is not None and data.nbytes != new.nbytes:
            raise GGUFError(f"tensor {name!r}: {data.nbytes} bytes made, {new.nbytes} announced")
        flat = memoryview(data.reshape(-1).view(np.uint8))
        for start in range(0, len(flat), _CHUNK):
            write(flat[start:start + _CHUNK].tobytes())
        write(bytes(-data.nbytes % align))
