"""The torch dequantizers (gguf/dequant_torch.py, what the GPU loader runs on the device) against
gguf-py's numpy reference, bitwise, for every type the CPU loader reads, on random blocks."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from tokenmill.gguf import dequant_torch
from tokenmill.gguf.weights import SUPPORTED_TYPES

Q = gguf.GGMLQuantizationType
# Byte ranges of each block type's float16 fields (scales, mins): random bytes there could be NaN or
# inf, whose payloads numpy and torch need not keep alike; they get random finite values instead.
F16_FIELDS = {
    Q.Q4_0: [(0, 2)], Q.Q4_1: [(0, 2), (2, 4)], Q.Q5_0: [(0, 2)], Q.Q5_1: [(0, 2), (2, 4)], Q.Q8_0: [(0, 2)],
    Q.Q4_K: [(0, 2), (2, 4)], Q.Q5_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)],
}
BLOCK_TYPES = sorted(F16_FIELDS, key=int)


def random_blocks(qtype: Q, n_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for lo, hi in F16_FIELDS[qtype]:
        # Signed values over many magnitudes, zeros and subnormals included.
        values = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)).astype(np.float16)
        values[:3] = [0.0, -0.0, 6e-8]
        blocks[:, lo:hi] = values.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def same_bits(ours: torch.Tensor, ref: np.ndarray) -> bool:
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    return ours.dtype == torch.float32 and torch.equal(ours.contiguous().view(torch.int32), ref_t.view(torch.int32))


def test_every_type_the_cpu_loader_reads_has_a_torch_dequantizer():
    assert SUPPORTED_TYPES <= dequant_torch.SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_blocks_match_gguf_py_bitwise(qtype):
    blocks = random_blocks(qtype, 512, seed=int(qtype))
    ours = dequant_torch.dequantize_blocks(torch.from_numpy(blocks), qtype)
    ref = quants.dequantize(blocks, qtype)
    assert ours.shape == ref.shape
    assert same_bits(ours, ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_a_tensor_in_rows_of_blocks(qtype):
    """Tensor data arrives as [rows, row_bytes]; the result takes the tensor's shape."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 512 // block_size
    data = random_blocks(qtype, rows * blocks_per_row, seed=7).reshape(rows, blocks_per_row * type_size)
    ours = dequant_torch.dequantize(torch.from_numpy(data), qtype, (rows, blocks_per_row * block_size))
    assert same_bits(ours, quants.dequantize(data, qtype))


def test_bf16_and_float_types():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 100
    bf16 = quants.quantize(x, Q.BF16)
    assert same_bits(dequant_torch.dequantize(torch.from_numpy(bf16), Q.BF16, (4, 64)), quants.dequantize(bf16, Q.BF16))
    f16 = x.astype(np.float16)
    assert same_bits(dequant_torch.dequantize(torch.from_numpy(f16), Q.F16, (4, 64)), f16.astype(np.float32))
    # The same bytes given as uint8, as a raw upload would carry them.
    assert same_bits(dequant_torch.dequantize(torch.from_numpy(f16.view(np.uint8)), Q.F16, (4, 64)),
                     f16.astype(np.float32))
    assert same_bits(dequant_torch.dequantize(torch.from_numpy(x), Q.F32, (4, 64)), x)


def test_quantized_round_trip_types_match_too():
    """Blocks that gguf-py's own quantizer wrote (not only random bytes)."""
    x = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        data = quants.quantize(x, qtype)
        assert same_bits(dequant_torch.dequantize(torch.from_numpy(data), qtype, x.shape),
                         quants.dequantize(data, qtype)), qtype.name


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="whole blocks"):
        dequant_torch.dequantize_blocks(torch.zeros(35, dtype=torch.uint8), Q.Q8_0)
    with pytest.raises(NotImplementedError):
        dequant_torch.dequantize_blocks(torch.zeros(110, dtype=torch.uint8), Q.IQ2_XXS)


def test_host_tensor_copies_a_read_only_big_endian_map():
    arr = np.arange(6, dtype=">f4").reshape(2, 3)
    arr.flags.writeable = False
    t = dequant_torch.host_tensor(arr)
    assert t.dtype == torch.float32 and t.tolist() == [[0, 1, 2], [3, 4, 5]]
