"""Open a GGUF file and expose its metadata as plain Python values and its tensors by name.

The header is parsed here directly (GGUF v2/v3, either byte order) rather than with
`gguf.GGUFReader`, which builds one numpy view per array element and takes seconds on a large
vocabulary. Metadata values are the same plain Python values `ReaderField.contents()` gives, and
tensor data are the same memory-mapped views `ReaderTensor.data` gives (typed elements for
F32/F16/F64/I8..I64, raw uint8 rows `[..., bytes_per_row]` for everything else, BF16 included).

Every failure while parsing becomes a GGUFError naming the file and the problem, so users never see
a stack trace from inside numpy's memmap or struct."""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_VT = gguf.GGUFValueType
# value type -> (struct/numpy format character, size in bytes)
_SCALARS: dict[int, tuple[str, int]] = {
    _VT.UINT8: ("B", 1), _VT.INT8: ("b", 1), _VT.UINT16: ("H", 2), _VT.INT16: ("h", 2),
    _VT.UINT32: ("I", 4), _VT.INT32: ("i", 4), _VT.FLOAT32: ("f", 4), _VT.BOOL: ("?", 1),
    _VT.UINT64: ("Q", 8), _VT.INT64: ("q", 8), _VT.FLOAT64: ("d", 8),
}
_STRING = int(_VT.STRING)
_ARRAY = int(_VT.ARRAY)

_Q = gguf.GGMLQuantizationType
# GGML types whose data GGUFReader exposes as typed elements; all others are raw uint8 rows.
_ELEMENT_DTYPES: dict[gguf.GGMLQuantizationType, str] = {
    _Q.F32: "f4", _Q.F16: "f2", _Q.F64: "f8", _Q.I8: "i1", _Q.I16: "i2", _Q.I32: "i4", _Q.I64: "i8",
}


class GGUFError(Exception):
    """The file is not a usable GGUF model; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (rows first), the reverse of GGUF's ne[]
    ggml_type: gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes or elements, memory-mapped


class GGUFFile:
    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], *,
                 version: int = 3, alignment: int = DEFAULT_ALIGNMENT, data_offset: int = 0,
                 mapping: mmap.mmap | None = None, metadata_end: int = 0, byte_order: str = "<"):
        self.path = path
        self.mapping = mapping  # the file's read-only map, which the tensors' data views
        self.metadata = metadata
        self.tensors = tensors
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.metadata_end = metadata_end  # where the tensor infos start (gguf/rewrite.py copies what is before)
        self.byte_order = byte_order

    def release_pages(self) -> None:
        """Drop the pages of the file this process has read (the loader calls it once the weights
        are repacked): they stay in the page cache, but no longer count in the process's resident
        memory; tensors still viewing the map (embedding rows) fault theirs back in on use."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

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

    def quantization_label(self) -> str:
        """The model's quantization as users know it (Q4_K_M): the file type the converter declared,
        else the dominant weight type. The two can differ: Gemma's huge Q8_0 embedding outweighs
        its Q4_K layers. Every listing (the CLI, /api/tags, /api/ps, /api/show) uses this one."""
        try:
            file_type = gguf.LlamaFileType(int(self.metadata.get("general.file_type")))
        except (TypeError, ValueError):
            return self.quantization_summary()
        return file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")

    def quantization_summary(self) -> str:
        """The dominant weight type of 2-D tensors, e.g. 'Q4_1'."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) >= 2:
                counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + int(np.prod(t.shape))
        return max(counts, key=counts.get) if counts else "unknown"


class _Parser:
    """A cursor over the file's bytes; every read is bounds-checked against the file size."""

    def __init__(self, path: Path, buf: memoryview, endian: str):
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.e = endian
        self._u32 = struct.Struct(endian + "I").unpack_from
        self._u64 = struct.Struct(endian + "Q").unpack_from

    # -- errors -------------------------------------------------------------------------------
    def truncated(self, what: str, need: int, at: int | None = None) -> GGUFError:
        at = self.pos if at is None else at
        return GGUFError(f"{self.path}: truncated or corrupt GGUF file: {what} at offset {at} needs "
                         f"{need} bytes but only {max(self.size - at, 0)} remain (file size {self.size})")

    def corrupt(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: corrupt GGUF file: {what}")

    # -- primitives ---------------------------------------------------------------------------
    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.truncated(what, n)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = self._u32(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = self._u64(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if self.pos + n > self.size:
            raise self.truncated(f"{what} (string length {n})", n)
        start = self.pos
        self.pos += n
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.corrupt(f"{what} at offset {start} is not valid UTF-8 ({exc.reason})") from None

    # -- metadata values ----------------------------------------------------------------------
    def value(self, vtype: int, what: str) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            fmt, size = scalar
            self.need(size, what)
            (v,) = struct.unpack_from(self.e + fmt, self.buf, self.pos)
            self.pos += size
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise self.corrupt(f"{what} has unknown value type {vtype} (at offset {self.pos - 4})")

    def array(self, what: str) -> list[Any]:
        etype = self.u32(f"element type of {what}")
        count = self.u64(f"element count of {what}")
        remaining = self.size - self.pos
        scalar = _SCALARS.get(etype)
        if scalar is not None:
            fmt, size = scalar
            if count * size > remaining:
                raise self.truncated(f"{what} ({count} elements of {size} bytes)", count * size)
            dtype = np.dtype(np.bool_) if fmt == "?" else np.dtype(self.e + fmt)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += count * size
            return values
        if etype == _STRING:
            if count * 8 > remaining:
                raise self.truncated(f"{what} ({count} strings)", count * 8)
            return self._strings(count, what)
        if etype == _ARRAY:
            # Nested arrays are flattened, as gguf.ReaderField.contents() does.
            if count * 12 > remaining:
                raise self.truncated(f"{what} ({count} nested arrays)", count * 12)
            out: list[Any] = []
            for i in range(count):
                out.extend(self.array(f"{what}[{i}]"))
            return out
        raise self.corrupt(f"{what} has unknown array element type {etype} (at offset {self.pos - 12})")

    def _strings(self, count: int, what: str) -> list[str]:
        buf, size, u64 = self.buf, self.size, self._u64
        pos = self.pos
        out: list[str] = [""] * count
        try:
            for i in range(count):
                (n,) = u64(buf, pos)
                pos += 8
                end = pos + n
                if end > size:
                    self.pos = pos
                    raise self.truncated(f"{what}[{i}] (string length {n})", n)
                out[i] = str(buf[pos:end], "utf-8")
                pos = end
        except struct.error:
            raise self.truncated(f"length of {what}[{i}]", 8, pos) from None
        except UnicodeDecodeError as exc:
            raise self.corrupt(f"{what}[{i}] at offset {pos} is not valid UTF-8 ({exc.reason})") from None
        self.pos = pos
        return out


def _parse(path: Path, mm: np.ndarray, mapping: mmap.mmap | None = None) -> GGUFFile:
    size = len(mm)
    buf = memoryview(mm)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    if size < 8:
        raise GGUFError(f"{path}: truncated GGUF file: {size} bytes, too short for a header")
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:  # written on a host of the other byte order, as GGUFReader detects it
        (version,) = struct.unpack_from(">I", buf, 4)
        endian = ">"
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: "
                        f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    p = _Parser(path, buf, endian)
    p.pos = 8
    tensor_count = p.u64("tensor count")
    kv_count = p.u64("metadata key/value count")
    # A key/value pair takes at least 13 bytes (key length, value type, one byte of value) and a
    # tensor info at least 24, so counts beyond what the file can hold are garbage.
    if kv_count * 13 > size - p.pos:
        raise p.truncated(f"{kv_count} metadata key/value pairs", kv_count * 13)
    if tensor_count * 24 > size - p.pos:
        raise p.truncated(f"{tensor_count} tensor infos", tensor_count * 24)

    metadata: dict[str, Any] = {}
    seen_keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = p.string(f"metadata key #{i}")
        if key in seen_keys:
            raise p.corrupt(f"duplicate metadata key {key!r}")
        seen_keys.add(key)
        vtype = p.u32(f"value type of metadata key {key!r}")
        value = p.value(vtype, f"metadata value {key!r}")
        if key == "general.alignment":
            if vtype != _VT.UINT32:
                raise p.corrupt(f"general.alignment has value type {vtype}, expected UINT32")
            if value == 0 or value & (value - 1):
                raise p.corrupt(f"general.alignment {value} is not a non-zero power of two")
            alignment = value
        if key.startswith("GGUF."):  # reserved for the header fields, as GGUFReader names them
            continue
        metadata[key] = value

    metadata_end = p.pos
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(tensor_count):
        name = p.string(f"name of tensor #{i}")
        n_dims = p.u32(f"dimension count of tensor {name!r}")
        p.need(8 * n_dims, f"dimensions of tensor {name!r} ({n_dims} dims)")
        dims = struct.unpack_from(f"{endian}{n_dims}Q", buf, p.pos)
        p.pos += 8 * n_dims
        raw_type = p.u32(f"type of tensor {name!r}")
        offset = p.u64(f"data offset of tensor {name!r}")
        infos.append((name, dims, raw_type, offset))

    data_offset = -(-p.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise p.corrupt(f"duplicate tensor {name!r}")
        try:
            ggml_type = _Q(raw_type)
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise p.corrupt(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        if offset % alignment:  # the native kernels read tensors at the alignment the file promises
            raise p.corrupt(f"tensor {name!r} has data offset {offset}, not a multiple of the alignment {alignment}")
        n_elems = math.prod(dims)
        n_bytes = n_elems * type_size // block_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise GGUFError(f"{path}: truncated or corrupt GGUF file: data of tensor {name!r} "
                            f"(bytes {start}..{start + n_bytes}) extends past the end of the file "
                            f"(size {size})")
        shape = tuple(reversed(dims))
        elem = _ELEMENT_DTYPES.get(ggml_type)
        if elem is not None:
            data = mm[start:start + n_bytes].view(np.dtype(endian + elem)).reshape(shape)
        else:
            if not dims or dims[0] % block_size:
                raise p.corrupt(f"tensor {name!r} of type {ggml_type.name} has row size "
                                f"{dims[0] if dims else 0}, not a multiple of the block size {block_size}")
            byte_shape = (*shape[:-1], dims[0] // block_size * type_size)
            data = mm[start:start + n_bytes].reshape(byte_shape)
        tensors[name] = TensorInfo(name, shape, ggml_type, data)
    return GGUFFile(path, metadata, tensors, version=version, alignment=alignment, data_offset=data_offset,
                    mapping=mapping, metadata_end=metadata_end, byte_order=endian)


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such model file")
    try:
        size = path.stat().st_size
        if size < 4:
            with path.open("rb") as f:
                magic = f.read()
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        with path.open("rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mm = np.frombuffer(mapping, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{path}: cannot read model file ({exc})") from exc
    try:
        return _parse(path, mm, mapping)
    except GGUFError:
        raise
    except Exception as exc:  # anything else is a damaged file we failed to anticipate
        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
