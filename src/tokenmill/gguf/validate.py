"""Check a GGUF file that someone else sent (a blob pushed to /api/blobs) before any model may use it.

The reader (reader.py) already refuses reads past the end of the file, but it builds every metadata
value in memory: a file that is all one huge array would cost gigabytes before it failed. This check
walks the same structure with a small buffered reader and holds nothing but the counts it needs, so
a hostile file is refused quickly and cheaply whatever its size:

- every count, length and dimension is checked against hard limits and against the bytes the file
  still has before it is used (a count of 2**63 fails at once; nothing is allocated from a count);
- every tensor has a known ggml type, 1 to 4 dimensions, an offset aligned as the file says and its
  data inside the file, with no two tensors overlapping (llama.cpp's own loader checks as much; the
  "Bleeding Llama" out-of-bounds read, Ollama's CVE-2026-7482, was a tensor running past the end);
- the architecture is one tokenmill serves, and its hyperparameters fit the tensors (gguf/config.py:
  a head count of 0 or a rotary dimension of 2**31 is refused here, not divided by or allocated for;
  every tensor the model reads is there, with the shape the hyperparameters give it);
- the vocabulary is one the tokenizer can be built from, with a token for every embedding row.

Messages describe the problem by position and number, never by the file's path or its bytes."""
from __future__ import annotations

import codecs
import math
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf

from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import DEFAULT_ALIGNMENT, GGUF_MAGIC, SUPPORTED_VERSIONS, GGUFError

# Far beyond any real model (Llama 3 405B has ~1,100 tensors and ~40 metadata keys; Gemma 3's
# vocabulary arrays have 262,144 entries), and small enough that walking them stays quick.
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_ARRAY = 1 << 24          # elements in one metadata array
MAX_ELEMENTS = 1 << 23       # array elements in all metadata together (Gemma 3: 786,432)
MAX_STRING = 1 << 24         # bytes in one string (a chat template is tens of KB)
MAX_NAME = 1 << 10           # bytes in a key or a tensor name (llama.cpp's tensor names: 64)
MAX_HEADER = 1 << 28         # bytes of header, metadata and tensor infos before the data
MAX_DIMS = 4                 # GGML_MAX_DIMS
KEPT_STRING = 256            # string values up to this many bytes are kept (names, tokenizer.ggml.model)

_VT = gguf.GGUFValueType
_SCALAR_SIZES = {_VT.UINT8: 1, _VT.INT8: 1, _VT.BOOL: 1, _VT.UINT16: 2, _VT.INT16: 2, _VT.UINT32: 4,
                 _VT.INT32: 4, _VT.FLOAT32: 4, _VT.UINT64: 8, _VT.INT64: 8, _VT.FLOAT64: 8}
_SCALAR_FORMATS = {_VT.UINT8: "B", _VT.INT8: "b", _VT.BOOL: "?", _VT.UINT16: "H", _VT.INT16: "h",
                   _VT.UINT32: "I", _VT.INT32: "i", _VT.FLOAT32: "f", _VT.UINT64: "Q", _VT.INT64: "q",
                   _VT.FLOAT64: "d"}
_CHUNK = 1 << 16
_READ_AHEAD = 1 << 20


class InvalidGGUF(GGUFError):
    """The file is not a GGUF model tokenmill may load; the message says why (without the path)."""


class ArrayInfo(Sequence):
    """What the check keeps of a metadata array: its length and element type, not its elements (the
    model's config needs the vocabulary's size, the tokenizer check that its tokens are strings)."""

    def __init__(self, count: int, element_type: int):
        self.count = count
        self.element_type = element_type

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        raise TypeError("the elements of a checked GGUF array are not kept")


class LongString(str):
    """A string value longer than KEPT_STRING: it reads as a placeholder saying its size."""

    def __new__(cls, size: int) -> "LongString":
        return super().__new__(cls, f"<a string of {size} bytes>")


@dataclass(frozen=True)
class GGUFSummary:
    architecture: str
    version: int
    tensor_count: int
    metadata_count: int
    data_offset: int
    file_size: int
    kind: str = "model"  # or "adapter": a LoRA adapter (gguf/lora.py), which no request may load as a model


class _Cursor:
    """Sequential reads over a file of known size; asking for bytes the file does not have fails
    before anything is read or allocated."""

    def __init__(self, f: BinaryIO, size: int):
        self.f = f
        self.size = size
        self.pos = 0
        self.endian = "<"

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise InvalidGGUF(f"truncated or corrupt GGUF file: {what} at offset {self.pos} needs {n} bytes, "
                              f"but the file has {self.size - self.pos} left")
        if self.pos + n > MAX_HEADER:
            raise InvalidGGUF(f"the GGUF header is larger than {MAX_HEADER} bytes ({what} at offset {self.pos})")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.f.read(n)
        if len(data) != n:
            raise InvalidGGUF(f"truncated GGUF file: {what} at offset {self.pos}")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.f.seek(n, 1)
        self.pos += n

    def u32(self, what: str) -> int:
        return struct.unpack(self.endian + "I", self.read(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack(self.endian + "Q", self.read(8, what))[0]

    def string(self, what: str, limit: int = MAX_STRING, keep_up_to: int = MAX_NAME) -> str:
        """A length-prefixed UTF-8 string, checked in pieces: its text, or a LongString standing for
        it when it is longer than `keep_up_to` bytes."""
        n = self.u64(f"length of {what}")
        if n > limit:
            raise InvalidGGUF(f"{what} at offset {self.pos - 8} claims {n} bytes; the limit is {limit}")
        self.need(n, what)
        keep = n <= keep_up_to
        decoder = codecs.getincrementaldecoder("utf-8")()
        parts = []
        left = n
        try:
            while left:
                piece = self.read(min(left, _CHUNK), what)
                left -= len(piece)
                text = decoder.decode(piece, final=not left)
                if keep:
                    parts.append(text)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InvalidGGUF(f"{what} ending at offset {self.pos} is not valid UTF-8") from None
        return "".join(parts) if keep else LongString(n)

    def strings(self, count: int, what: str) -> None:
        """`count` length-prefixed strings, each checked to be UTF-8 within MAX_STRING, none kept. The
        file is read in large pieces (a vocabulary is hundreds of thousands of short strings)."""
        unpack = struct.Struct(self.endian + "Q").unpack_from
        buf, at = b"", 0
        for i in range(count):
            if len(buf) - at < 8:
                buf, at = self._refill(buf, at, 8, f"length of {what}[{i}]")
            (n,) = unpack(buf, at)
            if n > MAX_STRING:
                raise InvalidGGUF(f"{what}[{i}] at offset {self.pos - len(buf) + at} claims {n} bytes; "
                                  f"the limit is {MAX_STRING}")
            at += 8
            if len(buf) - at < n:
                buf, at = self._refill(buf, at, n, f"{what}[{i}]")
            try:
                str(memoryview(buf)[at:at + n], "utf-8")
            except UnicodeDecodeError:
                raise InvalidGGUF(f"{what}[{i}] is not valid UTF-8") from None
            at += n
        # Give back what was read ahead.
        self.f.seek(at - len(buf), 1)
        self.pos -= len(buf) - at

    def _refill(self, buf: bytes, at: int, n: int, what: str) -> tuple[bytes, int]:
        """`buf[at:]` followed by at least enough of the file to hold `n` bytes from `at`."""
        rest = buf[at:]
        want = n - len(rest)
        here = self.pos - len(rest)  # where `what` starts
        if want > self.size - self.pos:
            raise InvalidGGUF(f"truncated or corrupt GGUF file: {what} at offset {here} needs {n} bytes, "
                              f"but the file has {self.size - here} left")
        if here + n > MAX_HEADER:
            raise InvalidGGUF(f"the GGUF header is larger than {MAX_HEADER} bytes ({what} at offset {here})")
        chunk = min(max(want, _READ_AHEAD), self.size - self.pos, MAX_HEADER - self.pos)
        data = self.f.read(chunk)
        if len(data) < want:
            raise InvalidGGUF(f"truncated GGUF file: {what} at offset {here}")
        self.pos += len(data)
        return rest + data, 0


class _Check:
    def __init__(self, cur: _Cursor):
        self.cur = cur
        self.elements = 0

    def value(self, vtype: int, what: str):
        """A number or a bool as itself, an array as an ArrayInfo (what the model's config needs of
        it, e.g. the vocabulary's size), a string as itself up to KEPT_STRING bytes, else a LongString."""
        size = _SCALAR_SIZES.get(vtype)
        if size is not None:
            (value,) = struct.unpack(self.cur.endian + _SCALAR_FORMATS[vtype], self.cur.read(size, what))
            return value
        if vtype == _VT.STRING:
            return self.cur.string(what, keep_up_to=KEPT_STRING)
        if vtype == _VT.ARRAY:
            return self.array(what)
        raise InvalidGGUF(f"{what} has unknown value type {vtype}")

    def array(self, what: str) -> ArrayInfo:
        cur = self.cur
        etype = cur.u32(f"element type of {what}")
        count = cur.u64(f"element count of {what}")
        if count > MAX_ARRAY:
            raise InvalidGGUF(f"{what} claims {count} elements; the limit is {MAX_ARRAY}")
        self.elements += count
        if self.elements > MAX_ELEMENTS:
            raise InvalidGGUF(f"the metadata arrays hold more than {MAX_ELEMENTS} elements in all")
        size = _SCALAR_SIZES.get(etype)
        if size is not None:
            cur.skip(count * size, f"{what} ({count} elements of {size} bytes)")
        elif etype == _VT.STRING:
            cur.need(count * 8, f"{what} ({count} strings)")  # each has at least its length
            cur.strings(count, what)
        elif etype == _VT.ARRAY:
            raise InvalidGGUF(f"{what} is an array of arrays, which GGUF models do not use")
        else:
            raise InvalidGGUF(f"{what} has unknown array element type {etype}")
        return ArrayInfo(count, etype)


def _header(cur: _Cursor) -> int:
    magic = cur.f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidGGUF("not a GGUF file")
    cur.pos = 4
    raw = cur.read(4, "version")
    (version,) = struct.unpack("<I", raw)
    if version & 0xFFFF == 0:  # written on a host of the other byte order
        cur.endian = ">"
        (version,) = struct.unpack(">I", raw)
    if version not in SUPPORTED_VERSIONS:
        raise InvalidGGUF(f"unsupported GGUF version {version} (supported: "
                          f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    return version


def _metadata(check: _Check, count: int) -> tuple[str | None, int, dict]:
    """(general.architecture, alignment, the other values: numbers and array lengths, strings None)."""
    cur = check.cur
    keys: set[str] = set()
    architecture, alignment = None, DEFAULT_ALIGNMENT
    values: dict = {}
    for i in range(count):
        key = cur.string(f"metadata key #{i}", MAX_NAME)
        if not key:
            raise InvalidGGUF(f"metadata key #{i} is empty")
        if key in keys:
            raise InvalidGGUF(f"metadata key #{i} is a duplicate")
        keys.add(key)
        vtype = cur.u32(f"value type of metadata key #{i}")
        if key == "general.architecture":
            if vtype != _VT.STRING:
                raise InvalidGGUF("general.architecture is not a string")
            architecture = cur.string("general.architecture", MAX_NAME)
        elif key == "general.alignment":
            if vtype != _VT.UINT32:
                raise InvalidGGUF(f"general.alignment has value type {vtype}, expected UINT32")
            alignment = cur.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise InvalidGGUF(f"general.alignment {alignment} is not a non-zero power of two")
        else:
            values[key] = check.value(vtype, f"metadata value #{i}")
    return architecture, alignment, values


@dataclass(frozen=True)
class _Tensor:
    index: int
    name: str
    shape: tuple[int, ...]  # PyTorch order, as the reader has it
    offset: int
    nbytes: int
    ggml_type: gguf.GGMLQuantizationType


def _tensor_info(cur: _Cursor, i: int, names: set[str], alignment: int) -> _Tensor:
    name = cur.string(f"name of tensor #{i}", MAX_NAME)
    if name in names:
        raise InvalidGGUF(f"tensor #{i} has the name of an earlier tensor")
    names.add(name)
    n_dims = cur.u32(f"dimension count of tensor #{i}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise InvalidGGUF(f"tensor #{i} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
    dims = struct.unpack(f"{cur.endian}{n_dims}Q", cur.read(8 * n_dims, f"dimensions of tensor #{i}"))
    raw_type = cur.u32(f"type of tensor #{i}")
    offset = cur.u64(f"data offset of tensor #{i}")
    try:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise InvalidGGUF(f"tensor #{i} has unknown ggml type {raw_type}") from None
    if any(d == 0 for d in dims):
        raise InvalidGGUF(f"tensor #{i} has a zero dimension")
    elements = math.prod(dims)
    if elements >= 1 << 62:
        raise InvalidGGUF(f"tensor #{i} claims {elements} elements")
    if dims[0] % block:
        raise InvalidGGUF(f"tensor #{i} of type {ggml_type.name} has row size {dims[0]}, not a multiple "
                          f"of its block size {block}")
    if offset % alignment:
        raise InvalidGGUF(f"tensor #{i} has data offset {offset}, not a multiple of the alignment {alignment}")
    return _Tensor(i, name, tuple(reversed(dims)), offset, elements // block * type_size, ggml_type)


def validate_gguf(path: str | Path, architectures: Collection[str]) -> GGUFSummary:
    """A summary of the GGUF file at `path`, or InvalidGGUF saying what is wrong with it."""
    path = Path(path)
    try:
        with path.open("rb", buffering=1 << 20) as f:
            size = path.stat().st_size
            return _validate(_Cursor(f, size), architectures)
    except OSError as exc:
        raise InvalidGGUF(f"the file cannot be read ({exc.strerror or type(exc).__name__})") from None


def _validate(cur: _Cursor, architectures: Collection[str]) -> GGUFSummary:
    if cur.size < 4:
        raise InvalidGGUF("not a GGUF file")
    version = _header(cur)
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata key/value count")
    if kv_count > MAX_KEYS:
        raise InvalidGGUF(f"the file claims {kv_count} metadata key/value pairs; the limit is {MAX_KEYS}")
    if tensor_count > MAX_TENSORS:
        raise InvalidGGUF(f"the file claims {tensor_count} tensors; the limit is {MAX_TENSORS}")
    # A key/value pair takes at least 13 bytes and a tensor info at least 32.
    cur.need(kv_count * 13 + tensor_count * 32, f"{kv_count} metadata pairs and {tensor_count} tensor infos")
    architecture, alignment, metadata = _metadata(_Check(cur), kv_count)
    if architecture is None:
        raise InvalidGGUF("general.architecture is missing")
    if architecture not in architectures:
        shown = architecture if len(architecture) <= 40 and architecture.isprintable() else architecture[:40] + "..."
        raise InvalidGGUF(f"unsupported architecture {shown!r} (supported: {', '.join(sorted(architectures))})")
    if tensor_count == 0:
        raise InvalidGGUF("the file has no tensors")
    names: set[str] = set()
    tensors = [_tensor_info(cur, i, names, alignment) for i in range(tensor_count)]
    data_offset = -(-cur.pos // alignment) * alignment
    end = data_offset
    for t in sorted(tensors, key=lambda t: t.offset):
        start = data_offset + t.offset
        if start < end:
            raise InvalidGGUF(f"tensor #{t.index}'s data overlaps another tensor's")
        end = start + t.nbytes
        if end > cur.size:
            raise InvalidGGUF(f"tensor #{t.index}'s data (bytes {start}..{end}) runs past the end of the file "
                              f"({cur.size} bytes)")
    _tensor_types(tensors)
    if metadata.get("general.type") == "adapter":
        _adapter(metadata, tensors)
        return GGUFSummary(architecture, version, tensor_count, kv_count, data_offset, cur.size, "adapter")
    shapes = {t.name: t.shape for t in tensors}
    _hyperparameters(architecture, metadata, shapes)
    _tokenizer(architecture, metadata, shapes)
    return GGUFSummary(architecture, version, tensor_count, kv_count, data_offset, cur.size)


def _adapter(metadata: dict, tensors: list[_Tensor]) -> None:
    """A LoRA adapter's own structure (gguf/lora.py checks it against a base when a model is made)."""
    if metadata.get("adapter.type") != "lora":
        raise InvalidGGUF("an adapter whose adapter.type is not 'lora'")
    for t in tensors:
        if len(t.shape) != 2 or not t.name.endswith((".lora_a", ".lora_b")):
            raise InvalidGGUF(f"adapter tensor #{t.index} is not a matrix named <tensor>.lora_a or <tensor>.lora_b")


def _tensor_types(tensors: list[_Tensor]) -> None:
    """Every tensor is of a type the loader can read (gguf/weights.py), as the loader itself requires:
    an IQ2_XXS file was kept, made a model, and failed on every request naming it."""
    from tokenmill.gguf.weights import SUPPORTED_TYPES

    for t in tensors:
        if t.ggml_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise InvalidGGUF(f"tensor #{t.index} has type {t.ggml_type.name}, which tokenmill cannot run "
                              f"(supported: {names})")


def _hyperparameters(architecture: str, metadata: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """The model's numbers must fit its tensors (gguf/config.py's checks), so that loading it later
    neither divides by zero nor allocates for a context or a rotary table of 2**32."""
    try:
        ModelConfig.from_metadata(architecture, metadata, shapes, "the file")
    except GGUFError as exc:
        raise InvalidGGUF(str(exc)) from None
    except (ValueError, TypeError, OverflowError) as exc:  # a number stored as a string or an array, ...
        raise InvalidGGUF(f"the model's hyperparameters cannot be read ({type(exc).__name__})") from None


def _tokenizer(architecture: str, metadata: Mapping, shapes: dict[str, tuple[int, ...]]) -> None:
    """The file's vocabulary is one the tokenizer can be built from (tokenizer/tokenizer.py), with a
    token for every row of the embedding, so that the model made from it loads rather than failing
    on every request."""
    from tokenmill.tokenizer.sentencepiece import GEMMA_ARCHITECTURES
    from tokenmill.tokenizer.tokenizer import unsupported_tokenizer

    def strings(key: str) -> ArrayInfo | None:
        value = metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, ArrayInfo) or value.element_type != _VT.STRING:
            raise InvalidGGUF(f"{key} is not an array of strings")
        return value

    tokens = strings("tokenizer.ggml.tokens")
    if not tokens:
        raise InvalidGGUF("the file has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
    rows = shapes["token_embd.weight"][0]  # the config's checks made sure it is there
    if len(tokens) != rows:
        raise InvalidGGUF(f"tokenizer.ggml.tokens has {len(tokens)} tokens, but token_embd.weight has {rows} rows")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None and not (isinstance(types, ArrayInfo) and types.element_type in _INTEGER_TYPES):
        raise InvalidGGUF("tokenizer.ggml.token_type is not an array of integers")
    model = metadata.get("tokenizer.ggml.model")
    problem = unsupported_tokenizer(model, metadata.get("tokenizer.ggml.pre"), architecture)
    if problem:
        raise InvalidGGUF(problem)
    if model == "gpt2" and not strings("tokenizer.ggml.merges"):
        raise InvalidGGUF("a byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') needs tokenizer.ggml.merges")
    if model == "llama" and architecture not in GEMMA_ARCHITECTURES and metadata.get("tokenizer.ggml.merges") is None:
        # Without merges, they are recovered from a score a token (Gemma's from the tokens' order).
        scores = metadata.get("tokenizer.ggml.scores")
        if not (isinstance(scores, ArrayInfo) and scores.element_type in (_VT.FLOAT32, _VT.FLOAT64)
                and len(scores) == len(tokens)):
            raise InvalidGGUF("a SentencePiece vocabulary (tokenizer.ggml.model 'llama') needs tokenizer.ggml.scores, "
                              "a number a token, or tokenizer.ggml.merges")


_INTEGER_TYPES = frozenset({_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64,
                            _VT.INT64})
