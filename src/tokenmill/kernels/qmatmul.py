"""y = x @ W^T straight from GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), as llama.cpp's
CPU backend does it: the weight is repacked once at load (no requantization), the activations are
quantized to int8 per block of 32 on every call (two planes: the value and its rounding residual), and the
kernel takes integer dot products.

APPROXIMATION: the activations are rounded to two int8 planes per block of 32: q1 with scale absmax/127
(llama.cpp's Q8 activations), then q2 for q1's rounding residual on a 128x finer grid (round half to
even), so x ~ d (128 q1 + q2) to within absmax/32512 per block. One plane alone (~4e-3 of absmax) cost a
third of greedy agreement with fp32; `tokenmill bench quality` measures it. The kernels join the two
planes' dot products as one integer, so the fp32 work is that of one plane and only the integer dot
products double. The weights are used exactly as the GGUF holds them; everything after the integer dot
products is fp32. The native kernels differ from `qmatmul_reference` only by fp32 summation order.

Every output row goes through the same fp32 operations whatever the batch holds and however many
threads run (the kernels split N, never K), so results are batch invariant bitwise. On AMX-INT8 CPUs
the AVX-512 variant computes whole groups of 16 rows' integer dot products on the tile unit
(csrc/qmatmul_amx.h): the same integers, then the same fp32 operations, so the same bits.

Repacked layout (see csrc/qmatmul_layout.h, which the kernels read): output rows are interleaved in
tiles of 16, so one 512-bit register holds 16 output columns. For each tile and each block of 32 inputs:
  qs: the 32 integer values of the 16 rows, unsigned (Q8_0 stored as q+128), grouped in 8 "steps" of
      4 consecutive inputs x 16 rows (byte 4*row + i). 4-bit types keep steps j and j+4 in the low and
      high nibbles of one 64-byte vector; Q5_0 adds one bit plane (bit t of byte 4*row+i = value bit 4
      of step t), Q6_K two 2-bit planes (plane p, bits 2t..2t+1 = value bits 4-5 of step 4p+t).
  sc: the block's per-row scales as the GGUF holds them (fp16 d; Q4_1 fp16 d then m; Q4_K u8 sc then
      u8 m; Q6_K int8 scales of the two 16-input halves).
  sup: per tile and 256-input super block (K-quants only): fp16 d (and Q4_K's fp16 dmin) per row.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import gguf
from tokenmill.kernels import native

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES: frozenset[Q] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K})
TILE = 16    # output rows interleaved together
BLOCK = 32   # inputs per activation block (and per weight group, except Q6_K's halves)
SUPER = 256  # K-quant super block
FINE = 128   # the second activation plane's grid is 1/FINE of the first's (csrc/qmatmul_layout.h kFine)
_QS_BYTES = {Q.Q4_0: 256, Q.Q4_1: 256, Q.Q5_0: 320, Q.Q8_0: 512, Q.Q4_K: 256, Q.Q6_K: 384}


# --- GGUF blocks -> integer values and scales (numpy, once at load) ---------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-block -> [..., 32] values: low nibbles hold the first 16."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _decode(raw: np.ndarray, t: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(values uint8 [n, k], per-32-block scale bytes [n, k/32, s], per-super-block bytes or None)."""
    nb = k // BLOCK
    if t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        size = gguf.GGML_QUANT_SIZES[t][1]
        b = raw.reshape(n, nb, size)
        if t == Q.Q4_0:
            return _nibbles32(b[..., 2:]).reshape(n, k), b[..., :2].copy(), None
        if t == Q.Q4_1:
            return _nibbles32(b[..., 4:]).reshape(n, k), b[..., :4].copy(), None
        if t == Q.Q8_0:
            return (b[..., 2:] ^ 0x80).reshape(n, k), b[..., :2].copy(), None
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # Q5_0: bit i of qh is value i's bit 4
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return (_nibbles32(b[..., 6:]) | (high << 4)).reshape(n, k), b[..., :2].copy(), None
    ns = k // SUPER
    if t == Q.Q4_K:
        b = raw.reshape(n * ns, 144)
        sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        qs = b[:, 16:].reshape(n * ns, 4, 32)  # 32 bytes per 64 values: low nibbles first
        values = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(n, k)
        scales = np.stack([sc.reshape(n, ns * 8), m.reshape(n, ns * 8)], -1).astype(np.uint8)
        return values, scales, b[:, :4].reshape(n, ns, 4).copy()
    b = raw.reshape(n * ns, 210)  # Q6_K: ql[128] qh[64] int8 scales[16] fp16 d
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(-1, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 2, 128)
    values = (low | (high << 4)).reshape(n, k)
    return values, b[:, 192:208].reshape(n, nb, 2).copy(), b[:, 208:210].reshape(n, ns, 2).copy()


def _tiles(a: np.ndarray, n_pad: int) -> np.ndarray:
    """[n, ...] -> [tiles, ..., 16 rows] with zero rows padding the last tile."""
    if n_pad != a.shape[0]:
        a = np.concatenate([a, np.zeros((n_pad - a.shape[0],) + a.shape[1:], a.dtype)])
    a = a.reshape((n_pad // TILE, TILE) + a.shape[1:])
    return np.moveaxis(a, 1, -1)


def _pack_values(values: np.ndarray, t: Q, n_pad: int) -> np.ndarray:
    nt, nb = n_pad // TILE, values.shape[1] // BLOCK
    v = _tiles(values.reshape(values.shape[0], nb, 8, 4), n_pad)  # [nt, nb, step, 4, row]
    v = np.ascontiguousarray(v.transpose(0, 1, 2, 4, 3))          # [nt, nb, step, row, 4]
    if t == Q.Q8_0:
        return v.reshape(nt, nb, 512)
    nib = ((v[:, :, :4] & 0xF) | ((v[:, :, 4:] & 0xF) << 4)).reshape(nt, nb, 256)
    if t == Q.Q5_0:
        bits = (v >> 4) & 1
        plane = (bits << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1, 1)).sum(2, dtype=np.uint8)
        return np.concatenate([nib, plane.reshape(nt, nb, 64)], -1)
    if t == Q.Q6_K:
        pair = ((v >> 4) & 3).reshape(nt, nb, 2, 4, TILE, 4)
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)
        planes = (pair << shifts).sum(3, dtype=np.uint8)
        return np.concatenate([nib, planes.reshape(nt, nb, 128)], -1)
    return nib


# --- the two objects the kernels take --------------------------------------------------------------

@dataclass
class QuantizedWeight:
    """A GGUF weight [N, K] repacked for the qmatmul kernels; holds the GGUF's exact values."""
    qs: torch.Tensor    # uint8 [tiles, K/32, qs bytes]
    sc: torch.Tensor    # uint8 [tiles, K/32, scale bytes]
    sup: torch.Tensor   # uint8 [tiles, K/256, bytes] (empty for 32-block types)
    out_features: int
    in_features: int
    ggml_type: Q

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, ggml_type: Q, shape: tuple[int, int]) -> "QuantizedWeight":
        t = Q(ggml_type)
        n, k = (int(s) for s in shape)
        if t not in SUPPORTED_TYPES:
            raise ValueError(f"qmatmul does not support {t.name}")
        block, size = gguf.GGML_QUANT_SIZES[t]
        if n <= 0 or k <= 0 or k % block:
            raise ValueError(f"{t.name} weight of shape {shape}: K must be a positive multiple of {block}")
        raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != n * (k // block) * size:
            raise ValueError(f"{t.name} [{n}, {k}] needs {n * (k // block) * size} uint8 bytes, got {raw.dtype} x {raw.size}")
        values, scales, sup = _decode(raw.reshape(-1), t, n, k)
        n_pad = -(-n // TILE) * TILE
        nt, nb = n_pad // TILE, k // BLOCK
        qs = _pack_values(values, t, n_pad)
        # scale bytes per row -> [tiles, blocks, part, 16 rows, bytes per part]
        sc = _tiles(_scale_parts(t, scales, n, nb), n_pad)  # [tiles, blocks, part, bytes, row]
        sc = np.ascontiguousarray(np.moveaxis(sc, -1, -2)).reshape(nt, nb, -1)
        if sup is None:
            sup_t = torch.empty((nt, 0, 0), dtype=torch.uint8)
        else:
            s = _tiles(sup.reshape(n, k // SUPER, -1, 2), n_pad)           # [nt, ns, part, 2, row]
            sup_t = torch.from_numpy(np.ascontiguousarray(s.transpose(0, 1, 2, 4, 3)).reshape(nt, k // SUPER, -1))
        return cls(torch.from_numpy(qs), torch.from_numpy(sc), sup_t, n, k, t)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in (self.qs, self.sc, self.sup))

    def moved(self, place: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedWeight":
        """The same weight with its arrays where place puts copies of them (kernels/huge_pages.py)."""
        return QuantizedWeight(place(self.qs), place(self.sc), place(self.sup), self.out_features,
                               self.in_features, self.ggml_type)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: exactly the GGUF's values."""
        u, scale, offset = self._unpack()
        return (u * scale + offset).reshape(-1, self.in_features)[: self.out_features]

    def _unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values fp32 [N_pad, K/g, g], scale, offset [N_pad, K/g, 1]) with w = values * scale + offset."""
        t, k = self.ggml_type, self.in_features
        nt, nb = self.qs.shape[:2]
        qs = self.qs.to(torch.int32)
        if t == Q.Q8_0:
            v = qs.view(nt, nb, 8, TILE, 4)
        else:
            nib = qs[..., :256].view(nt, nb, 4, TILE, 4)
            v = torch.cat([nib & 0xF, nib >> 4], 2)
            if t == Q.Q5_0:
                plane = qs[..., 256:].view(nt, nb, 1, TILE, 4)
                v = v | (((plane >> torch.arange(8).view(1, 1, 8, 1, 1)) & 1) << 4)
            elif t == Q.Q6_K:
                planes = qs[..., 256:].view(nt, nb, 2, 1, TILE, 4)
                hi = (planes >> (2 * torch.arange(4)).view(1, 1, 1, 4, 1, 1)) & 3
                v = v | (hi.reshape(nt, nb, 8, TILE, 4) << 4)
        v = v.permute(0, 3, 1, 2, 4).reshape(nt * TILE, k).float()       # [N_pad, K]
        per_part = 1 if t in (Q.Q4_K, Q.Q6_K) else 2
        sc = self.sc.view(nt, nb, -1, TILE, per_part)
        sc = sc.permute(0, 3, 1, 2, 4).reshape(nt * TILE, nb, -1)          # bytes per (row, block)
        if t == Q.Q4_K or t == Q.Q6_K:
            sup = self.sup.view(nt, k // SUPER, -1, TILE, 2).permute(0, 3, 1, 2, 4).reshape(nt * TILE, k // SUPER, -1)
            sup = sup.contiguous().view(torch.float16).float().repeat_interleave(SUPER // BLOCK, 1)  # [N_pad, nb, parts]
        if t == Q.Q4_K:
            scale, offset = sup[..., 0] * sc[..., 0].float(), -(sup[..., 1] * sc[..., 1].float())
            return v.view(-1, nb, BLOCK), scale[..., None], offset[..., None]
        if t == Q.Q6_K:
            scale = (sup[..., :1] * sc.view(torch.int8).float()).reshape(-1, nb * 2, 1)
            return v.view(-1, nb * 2, 16) - 32, scale, torch.zeros_like(scale)
        f = sc.contiguous().view(torch.float16).float()                    # [N_pad, nb, 1 or 2]
        d = f[..., :1]
        offset = {Q.Q4_0: -8 * d, Q.Q5_0: -16 * d, Q.Q8_0: -128 * d}.get(t)
        return v.view(-1, nb, BLOCK), d, (f[..., 1:] if t == Q.Q4_1 else offset)


def _scale_parts(t: Q, scales: np.ndarray, n: int, nb: int) -> np.ndarray:
    """Per-block scale bytes [n, nb, s] -> [n, nb, parts, bytes per part]: parts are stored one after
    the other, each as 16 rows."""
    if t == Q.Q4_1:
        return scales.reshape(n, nb, 2, 2)   # fp16 d, fp16 m
    if t in (Q.Q4_K, Q.Q6_K):
        return scales.reshape(n, nb, 2, 1)   # (sc, m) or the two halves' scales
    return scales.reshape(n, nb, 1, 2)       # fp16 d


@dataclass
class QuantizedActivations:
    """x [M, K] as two int8 planes per block of 32: q1 = round(x / d1) with d1 = absmax/127, and
    q2 = round((x - d1 q1) / (d1/128)) in [-64, 64], the rounding residual on a 128x finer grid, so
    x ~ d (128 q1 + q2) with d = d1/128. One byte row per input row (a single tensor, so a call allocates
    once): q1 int8 [K] | q2 int8 [K] | d fp32 [K/32] | ds = d * S fp32 [K/32] | S int32 [K/16] per 16,
    where S = 128 sum(q1) + sum(q2). ds and S serve the weights' offsets."""
    data: torch.Tensor  # uint8 [M, 5K/2]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] * 2 // 5

    def _part(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data[:, start:stop].contiguous().view(dtype)

    @property
    def q(self) -> torch.Tensor:
        """int8 [M, 2, K]: the two planes."""
        m, k = self.shape
        return self._part(0, 2 * k, torch.int8).view(m, 2, k)

    @property
    def d(self) -> torch.Tensor:
        k = self.shape[1]
        return self._part(2 * k, 2 * k + k // 8, torch.float32)

    @property
    def ds(self) -> torch.Tensor:
        k = self.shape[1]
        return self._part(2 * k + k // 8, 2 * k + k // 4, torch.float32)

    @property
    def s16(self) -> torch.Tensor:
        k = self.shape[1]
        return self._part(2 * k + k // 4, 2 * k + k // 2, torch.int32)

    def dequantize(self) -> torch.Tensor:
        """fp32 [M, K]: the activations the kernels multiply, d * (128 q1 + q2)."""
        m, k = self.shape
        q = self.q.to(torch.int32)
        joined = (q[:, 0] * FINE + q[:, 1]).float().view(m, -1, BLOCK)
        return (joined * self.d[..., None]).view(m, k)


def _row_bytes(k: int) -> int:
    return 2 * k + k // 2


def _quantize_reference(x: torch.Tensor) -> torch.Tensor:
    """The kernels' quantization, operation for operation (each an IEEE single-precision op)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d1 = amax / 127.0
    coarse = torch.round(blocks * inv)
    fine = torch.round((blocks - coarse * d1) * (inv * FINE))
    q1, q2 = coarse.to(torch.int8), fine.to(torch.int8)
    s16 = (q1.to(torch.int32) * FINE + q2.to(torch.int32)).view(m, -1, 16).sum(-1, dtype=torch.int32)
    d = (d1 * (1.0 / FINE)).view(m, -1)
    ds = d * s16.view(m, -1, 2).sum(-1).float()
    return torch.cat([t.reshape(m, -1).view(torch.uint8) for t in (q1, q2, d, ds, s16)], 1)


def _quantize_impl(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"activations must be [M, K] with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    mod = native.module()
    if mod is None:
        return _quantize_reference(x)
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    out = torch.empty((m, _row_bytes(k)), dtype=torch.uint8)
    mod.quantize_activations(x.data_ptr(), m, k, x.stride(0), out.data_ptr())
    return out


@torch.library.custom_op("tokenmill::quantize_activations", mutates_args=())
def _quantize_op(x: torch.Tensor) -> torch.Tensor:
    return _quantize_impl(x)


@_quantize_op.register_fake
def _quantize_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], _row_bytes(x.shape[1])), dtype=torch.uint8)


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """x fp32 [M, K] -> two int8 planes per block of 32 (the approximation this module's docstring
    describes)."""
    return QuantizedActivations(_quantize_op(x) if torch.compiler.is_compiling() else _quantize_impl(x))


# --- the matmul ------------------------------------------------------------------------------------

def _qmatmul_impl(acts, qs, sc, sup, ggml_type: int, n: int, out: torch.Tensor) -> None:
    mod = native.module()
    m, k = QuantizedActivations(acts).shape
    if mod is None:
        out.copy_(_reference(QuantizedActivations(acts), QuantizedWeight(qs, sc, sup, n, k, Q(ggml_type))))
        return
    mod.qmatmul(int(ggml_type), acts.data_ptr(), m, k, qs.data_ptr(), sc.data_ptr(), sup.data_ptr(), n,
                out.data_ptr(), out.stride(0))


@torch.library.custom_op("tokenmill::qmatmul", mutates_args=())
def _qmatmul_op(acts: torch.Tensor, qs: torch.Tensor, sc: torch.Tensor, sup: torch.Tensor, ggml_type: int,
                n: int) -> torch.Tensor:
    out = torch.empty((acts.shape[0], n))
    _qmatmul_impl(acts, qs, sc, sup, ggml_type, n, out)
    return out


@_qmatmul_op.register_fake
def _qmatmul_fake(acts, qs, sc, sup, ggml_type: int, n: int) -> torch.Tensor:
    return acts.new_empty((acts.shape[0], n), dtype=torch.float32)


def qmatmul(x: torch.Tensor | QuantizedActivations, w: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, N] = x @ W^T, x fp32 [M, K] or already quantized (one quantization can serve several
    weights reading the same input). `out` may be a column slice of a wider [M, N_total] fp32 tensor
    (unit column stride, any row stride)."""
    a = x if isinstance(x, QuantizedActivations) else quantize_activations(x)
    m, k = a.shape
    if k != w.in_features:
        raise ValueError(f"activations have K={k}, the weight {w.in_features}")
    if torch.compiler.is_compiling():
        y = _qmatmul_op(a.data, w.qs, w.sc, w.sup, int(w.ggml_type), w.out_features)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty((m, w.out_features))
    elif out.shape != (m, w.out_features) or out.dtype != torch.float32 or (m > 0 and out.stride(1) != 1):
        raise ValueError(f"out must be fp32 [{m}, {w.out_features}] with unit column stride")
    if m > 0:
        _qmatmul_impl(a.data, w.qs, w.sc, w.sup, int(w.ggml_type), w.out_features, out)
    return out


def _reference(a: QuantizedActivations, w: QuantizedWeight) -> torch.Tensor:
    return F.linear(a.dequantize(), w.dequantize())


def qmatmul_reference(x: torch.Tensor | QuantizedActivations, w: QuantizedWeight) -> torch.Tensor:
    """The same math in PyTorch: activations quantized exactly as the kernels do, weights dequantized
    exactly, an fp32 matmul (the kernels differ only in fp32 summation order)."""
    a = x if isinstance(x, QuantizedActivations) else QuantizedActivations(_quantize_reference(x))
    return _reference(a, w)
