"""Our GGUF parser against gguf.GGUFReader (the reference), plus damaged files -> GGUFError."""
from __future__ import annotations

import os
import random
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.gguf.reader import GGUFError, open_gguf
from tokenmill.gguf.weights import dequantize

Q = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType


# --- the reference: gguf.GGUFReader, converted the way the old reader did --------------------------

def reference(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], Q, np.ndarray]]]:
    reader = gguf.GGUFReader(str(path), "r")
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        metadata[key] = value.item() if isinstance(value, np.generic) else value
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), Q(t.tensor_type), t.data)
               for t in reader.tensors}
    return metadata, tensors


def assert_matches_reference(path: Path, *, data_every: int = 1) -> None:
    g = open_gguf(path)
    ref_meta, ref_tensors = reference(path)
    assert list(g.metadata) == list(ref_meta)
    for key, expected in ref_meta.items():
        got = g.metadata[key]
        assert type(got) is type(expected), key
        assert got == expected, key
        if isinstance(expected, list):
            assert [type(x) for x in got] == [type(x) for x in expected], key
    assert list(g.tensors) == list(ref_tensors)
    for i, (name, (shape, qtype, data)) in enumerate(ref_tensors.items()):
        t = g.tensors[name]
        assert t.name == name
        assert t.shape == shape, name
        assert t.ggml_type is qtype, name
        assert t.data.shape == data.shape and t.data.dtype == data.dtype, name
        if i % data_every == 0 or i == len(ref_tensors) - 1:
            assert t.data.tobytes() == data.tobytes(), name  # bytes: random payloads hold NaNs


# --- hand-built files, for layouts GGUFWriter will not write ------------------------------------------

def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _build(kvs: list[bytes], tensor_infos: list[bytes] = (), data: bytes = b"", *,
           magic: bytes = b"GGUF", version: int = 3, alignment: int = 32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensor_infos), len(kvs)) + b"".join(kvs) + b"".join(tensor_infos)
    return head + b"\0" * (-len(head) % alignment) + data


def _tensor_info(name: str, dims: list[int], ggml_type: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def _write(tmp_path: Path, content: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def _expect_error(path: Path, *words: str) -> str:
    with pytest.raises(GGUFError) as info:
        open_gguf(path)
    msg = str(info.value)
    assert str(path) in msg
    assert any(w in msg.lower() for w in words), msg
    return msg


# --- parity with gguf.GGUFReader -----------------------------------------------------------------

def test_tiny_model_matches_reference(tiny_gguf):
    assert_matches_reference(tiny_gguf)
    g = open_gguf(tiny_gguf)
    assert g.architecture == "llama"
    assert g.get("llama.block_count") == 2 and g.require("tokenizer.ggml.model") == "gpt2"
    assert g.get("missing", 7) == 7
    assert g.quantization_summary() == "F32"
    with pytest.raises(GGUFError, match="missing"):
        g.require("no.such.key")


@pytest.mark.parametrize("wtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_tiny_model_weight_types_match_reference(tmp_path, wtype):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=wtype, n_layers=1))
    assert_matches_reference(path)
    g = open_gguf(path)
    assert g.quantization_summary() == wtype.name
    t = g.tensors["blk.0.attn_q.weight"]
    assert dequantize(t, torch.float32).shape == t.shape


def test_every_value_and_tensor_type_matches_reference(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for i, (vtype, value) in enumerate([
        (VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000), (VT.INT16, -30000), (VT.UINT32, 4_000_000_000),
        (VT.INT32, -2_000_000_000), (VT.FLOAT32, 0.1), (VT.BOOL, True), (VT.BOOL, False),
        (VT.UINT64, 2**63 + 5), (VT.INT64, -(2**62)), (VT.FLOAT64, 1e-300), (VT.STRING, "héllo ✓ \0 z"),
    ]):
        w.add_key_value(f"test.scalar{i}", value, vtype)
    for vtype in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64):
        w.add_key_value(f"test.array_{vtype.name}", [1, 2, 3, 100], VT.ARRAY, sub_type=vtype)
    w.add_key_value("test.array_f32", [0.5, -1.25, 3.1], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("test.array_f64", [0.1, 1e100], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_key_value("test.array_bool", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_array("test.array_str", ["", "a", "ü€𝄞", "x" * 1000])
    w.add_array("test.nested_int", [[1, 2], [3], [4, 5, 6]])
    w.add_array("test.nested_str", [["a", "b"], ["c"]])
    for qtype, shape in [(Q.F32, (3, 5)), (Q.F16, (4,)), (Q.F64, (2, 2)), (Q.I8, (7,)), (Q.I16, (2, 3)),
                         (Q.I32, (1, 1, 3)), (Q.I64, (2,)), (Q.Q4_K, (2, 512)), (Q.Q6_K, (3, 256)),
                         (Q.Q8_0, (64,)), (Q.IQ4_NL, (1, 2, 64))]:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        raw = rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
        w.add_tensor(f"t.{qtype.name}", raw, raw_shape=byte_shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_matches_reference(path)
    g = open_gguf(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert g.metadata["test.nested_int"] == [1, 2, 3, 4, 5, 6]  # flattened, as gguf.ReaderField does
    assert g.tensors["t.Q4_K"].shape == (2, 512) and g.tensors["t.Q4_K"].data.shape == (2, 288)


def test_big_endian_file_matches_reference(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("test.u32", 123456)
    w.add_float32("test.f32", 2.5)
    w.add_array("test.tokens", ["a", "bc"])
    w.add_key_value("test.scores", [1.5, -2.0], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_matches_reference(path)
    g = open_gguf(path)
    assert g.metadata["test.u32"] == 123456
    np.testing.assert_array_equal(np.asarray(g.tensors["w"].data, dtype=np.float32),
                                  np.arange(12, dtype=np.float32).reshape(3, 4))


def test_empty_array_and_v2(tmp_path):
    kvs = [_kv("general.architecture", VT.STRING, _s("llama")),
           _kv("test.empty", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)),
           _kv("test.empty_str", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0))]
    data = np.arange(4, dtype=np.float32).tobytes()
    path = _write(tmp_path, _build(kvs, [_tensor_info("w", [4], Q.F32)], data, version=2))
    assert_matches_reference(path)
    g = open_gguf(path)
    assert g.metadata["test.empty"] == [] and g.metadata["test.empty_str"] == []
    assert g.version == 2


@pytest.mark.real_model
def test_smollm2_matches_reference(smollm2_path):
    assert_matches_reference(smollm2_path, data_every=7)


def _gemma_path() -> Path | None:
    home = Path(os.environ.get("TOKENMILL_HOME") or "~/.cache/tokenmill").expanduser()
    found = sorted((home / "models").glob("gemma-3*.gguf"))
    return found[0] if found else None


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_matches_reference():
    path = _gemma_path()
    if path is None:
        pytest.skip("no Gemma 3 GGUF under the tokenmill model store")
    assert_matches_reference(path, data_every=7)
    assert len(open_gguf(path).metadata["tokenizer.ggml.tokens"]) == 262144


# --- damaged files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bytes(tiny_gguf) -> bytes:
    return tiny_gguf.read_bytes()


@pytest.fixture(scope="module")
def tiny_layout(tiny_gguf) -> dict[str, int]:
    """Offsets inside the tiny file, from the reference reader."""
    reader = gguf.GGUFReader(str(tiny_gguf), "r")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    first_tensor = reader.tensors[0].field
    last = reader.tensors[-1]
    return {
        "tokens_field": tokens.offset,
        "tokens_mid": tokens.offset + sum(int(p.nbytes) for p in tokens.parts) // 2,
        "tensor_info": first_tensor.offset,
        "tensor_info_mid": reader.tensors[len(reader.tensors) // 2].field.offset + 5,
        "tensor0_type": first_tensor.offset + sum(int(p.nbytes) for p in first_tensor.parts[:4]),
        "tensor0_offset": first_tensor.offset + sum(int(p.nbytes) for p in first_tensor.parts[:5]),
        "data_offset": reader.data_offset,
        "data_mid": last.data_offset + last.n_bytes // 2,
    }


@pytest.mark.parametrize("where", ["header", "counts", "first_key", "tokens_mid", "tensor_info",
                                   "tensor_info_mid", "data_offset", "data_mid"])
def test_truncated_file(tmp_path, tiny_bytes, tiny_layout, where):
    cut = {"header": 6, "counts": 20, "first_key": 30}.get(where) or tiny_layout[where]
    path = _write(tmp_path, tiny_bytes[:cut])
    _expect_error(path, "truncat")


def test_truncated_anywhere_raises_gguf_error(tmp_path, tiny_bytes, tiny_layout):
    rng = random.Random(0)
    end = tiny_layout["data_offset"] + 64
    cuts = sorted({*range(4, 64), *rng.sample(range(64, end), 150)})
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(tiny_bytes[:cut])
        with pytest.raises(GGUFError, match="(?i)truncat"):
            open_gguf(path)


def test_random_corruption_never_escapes_as_another_exception(tmp_path, tiny_bytes, tiny_layout):
    rng = random.Random(1)
    path = tmp_path / "flip.gguf"
    header = tiny_layout["data_offset"]
    for _ in range(300):
        buf = bytearray(tiny_bytes)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(4, header)] = rng.randrange(256)
        path.write_bytes(bytes(buf))
        try:
            open_gguf(path)
        except GGUFError:
            pass


@pytest.mark.parametrize("content", [b"", b"GG", b"\0" * 4096, b"GGML" + b"\0" * 100, b"PK\x03\x04" * 50])
def test_not_a_gguf_file(tmp_path, content):
    _expect_error(_write(tmp_path, content), "not a gguf file")


@pytest.mark.parametrize("version", [0, 1, 4, 99])
def test_unsupported_version(tmp_path, tiny_bytes, version):
    path = _write(tmp_path, tiny_bytes[:4] + struct.pack("<I", version) + tiny_bytes[8:])
    msg = _expect_error(path, "unsupported gguf version")
    assert str(version) in msg


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such model file"):
        open_gguf(tmp_path / "nope.gguf")


def _patched(tiny_bytes: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(tiny_bytes)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def test_unknown_ggml_type_is_named(tmp_path, tiny_bytes, tiny_layout):
    path = _write(tmp_path, _patched(tiny_bytes, tiny_layout["tensor0_type"], "<I", 77))
    msg = _expect_error(path, "unknown ggml type")
    assert "77" in msg and "token_embd.weight" in msg


def test_tensor_data_past_end_of_file(tmp_path, tiny_bytes, tiny_layout):
    path = _write(tmp_path, _patched(tiny_bytes, tiny_layout["tensor0_offset"], "<Q", len(tiny_bytes)))
    _expect_error(path, "truncat")


@pytest.mark.parametrize("count_field, value", [(8, 2**40), (16, 2**40), (8, 2**64 - 1)])
def test_garbage_counts(tmp_path, tiny_bytes, count_field, value):
    path = _write(tmp_path, _patched(tiny_bytes, count_field, "<Q", value))
    _expect_error(path, "truncat", "corrupt")


def test_garbage_string_and_array_lengths(tmp_path, tiny_bytes, tiny_layout):
    _expect_error(_write(tmp_path, _patched(tiny_bytes, 24, "<Q", 2**50), "key.gguf"), "truncat")
    tokens = tiny_layout["tokens_field"]
    key_len = struct.unpack_from("<Q", tiny_bytes, tokens)[0]
    count_at = tokens + 8 + key_len + 4 + 4
    _expect_error(_write(tmp_path, _patched(tiny_bytes, count_at, "<Q", 2**62), "count.gguf"), "truncat")
    first_len_at = count_at + 8
    _expect_error(_write(tmp_path, _patched(tiny_bytes, first_len_at, "<Q", 2**33), "len.gguf"), "truncat")


@pytest.mark.parametrize("payload, words", [
    (_kv("x.bad", 13, b"\0" * 8), ("unknown value type 13",)),
    (_kv("x.bad", VT.ARRAY, struct.pack("<IQ", 42, 1) + b"\0" * 8), ("unknown array element type 42",)),
    (_kv("x.bad", VT.STRING, _s(b"\xff\xfe")), ("utf-8",)),
    (_kv("general.alignment", VT.UINT32, struct.pack("<I", 48)), ("power of two",)),
    (_kv("general.alignment", VT.UINT64, struct.pack("<Q", 64)), ("general.alignment",)),
])
def test_corrupt_metadata(tmp_path, payload, words):
    kvs = [_kv("general.architecture", VT.STRING, _s("llama")), payload]
    msg = _expect_error(_write(tmp_path, _build(kvs)), "corrupt")
    assert all(w.lower() in msg.lower() for w in words), msg


def test_duplicates_are_errors(tmp_path):
    arch = _kv("general.architecture", VT.STRING, _s("llama"))
    _expect_error(_write(tmp_path, _build([arch, arch]), "k.gguf"), "duplicate metadata key")
    infos = [_tensor_info("w", [4], Q.F32), _tensor_info("w", [4], Q.F32)]
    _expect_error(_write(tmp_path, _build([arch], infos, b"\0" * 16), "t.gguf"), "duplicate tensor")


def test_quantized_row_not_a_block_multiple(tmp_path):
    arch = _kv("general.architecture", VT.STRING, _s("llama"))
    path = _write(tmp_path, _build([arch], [_tensor_info("w", [48, 2], Q.Q8_0)], b"\0" * 256))
    _expect_error(path, "block size")


def test_garbage_dimension_count(tmp_path):
    arch = _kv("general.architecture", VT.STRING, _s("llama"))
    info = _s("w") + struct.pack("<I", 2**31) + b"\0" * 40
    _expect_error(_write(tmp_path, _build([arch], [info])), "truncat")
