"""Open a GGUF file and expose its metadata as plain Python values and its tensors by name.

Every failure while parsing becomes a GGUFError naming the file and the problem, so users never see
a stack trace from inside numpy's memmap or the gguf package."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"


class GGUFError(Exception):
    """The file is not a usable GGUF model; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (rows first), the reverse of GGUF's ne[]
    ggml_type: gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes or elements, memory-mapped


def _field_value(field: gguf.ReaderField) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


class GGUFFile:
    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self.path = path
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _field_value(field)
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, shape, gguf.GGMLQuantizationType(t.tensor_type), t.data)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: missing general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    def quantization_summary(self) -> str:
        """The dominant weight type of 2-D tensors, e.g. 'Q4_1'."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) >= 2:
                counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + int(np.prod(t.shape))
        return max(counts, key=counts.get) if counts else "unknown"


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such model file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf package raises ValueError/IndexError/KeyError on damage
        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
    try:
        return GGUFFile(path, reader)
    except ValueError as exc:
        raise GGUFError(f"{path}: unsupported tensor type ({exc})") from exc
