"""GGUF blocks dequantized with torch ops, on whatever device the bytes are on: the GPU path uploads a
tensor's quantized bytes and expands them there (a tenth of the bytes cross the bus for a Q4 file,
and no CPU pass over every weight).

Each type follows ggml's block layout (ggml-common.h) with the float32 arithmetic in the order
gguf-py's numpy reference (`gguf.quants.dequantize`) uses, one rounding per operation and no fused
multiply-add, so the result is bitwise the CPU loader's (tests/gguf/test_dequant_torch.py checks every
type on random blocks). Rounding to bf16 then happens once, from float32, as the CPU path does.

Byte views (`uint8 -> float16`) need the bytes of a block field to be contiguous; the functions take
`blocks` as a contiguous uint8 [n_blocks, type_size] tensor and return float32 [n_blocks, block_size]."""
from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
QK_K = 256


def _f16(field: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> float32 [n, 1], read as little-endian float16."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Bytes [n, groups * width] -> [n, groups, 2, width] nibbles: ggml stores the first `width`
    values of a group in the low nibbles of its bytes and the next `width` in the high ones."""
    q = qs.reshape(-1, groups, 1, width)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(qh: torch.Tensor, n_bits: int) -> torch.Tensor:
    """[n, n_bits // 8] bytes of a little-endian bit field -> uint8 [n, n_bits], bit j = value j's bit."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], n_bits)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 1, 16).reshape(-1, 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 1, 16).reshape(-1, 32).float()
    return d * q + m


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The 5-bit values of a Q5_0/Q5_1 block whose high-bit word starts at byte `offset`."""
    high = _bits(b[:, offset:offset + 4], 32)
    low = _nibbles(b[:, offset + 4:], 1, 16).reshape(-1, 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _q5(b, 4).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> two float32 [n, 8]. Bytes
    0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7; bytes 4-7 the same for mins;
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: value = (d * scale) * q - (dmin * min) per 32-value sub-block; q [n, 8, 32]."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scale = (d * sc).unsqueeze(-1)
    offset = (dmin * mn).unsqueeze(-1)
    return (scale * q.float() - offset).reshape(-1, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 4, 32).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # 32 bytes of high bits: bit j of byte i is the fifth bit of value i of sub-block j.
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1
    low = _nibbles(b[:, 48:], 4, 32).reshape(-1, 8, 32)
    return _k_affine(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles (two halves of 64 bytes, each: values 0-63 low, 64-127 high), 64 bytes
    # of 2-bit high parts (two halves of 32 bytes, four values a byte), 16 int8 scales, an f16 d.
    low = _nibbles(b[:, :128], 2, 64).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d * scales).unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


_BLOCKS = {
    Q.BF16: _bf16, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, *_BLOCKS})


def dequantize_blocks(blocks: torch.Tensor, ggml_type: Q) -> torch.Tensor:
    """uint8 [n_blocks, type_size] (or any shape whose bytes are whole blocks) -> float32
    [n_blocks, block_size], on blocks' device."""
    fn = _BLOCKS.get(ggml_type)
    if fn is None:
        raise NotImplementedError(f"no torch dequantizer for {ggml_type.name}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    if blocks.dtype != torch.uint8 or blocks.numel() % type_size:
        raise ValueError(f"{ggml_type.name} blocks must be uint8 in whole blocks of {type_size} bytes")
    return fn(blocks.reshape(-1, type_size).contiguous())


def dequantize(data: torch.Tensor, ggml_type: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's data as uploaded (float32/float16 elements, or uint8 block bytes) -> float32
    of `shape` (PyTorch order), on data's device."""
    if ggml_type == Q.F32:
        out = data.view(torch.float32) if data.dtype == torch.uint8 else data.float()
    elif ggml_type == Q.F16:
        out = (data.view(torch.float16) if data.dtype == torch.uint8 else data).float()
    else:
        out = dequantize_blocks(data, ggml_type)
    return out.reshape(shape)


def host_tensor(data: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's memory-mapped data as a CPU tensor ready to upload: a native-endian copy (the
    map is read-only, and torch wants writable memory)."""
    arr = np.asarray(data)
    return torch.from_numpy(np.array(arr, dtype=arr.dtype.newbyteorder("=")))
