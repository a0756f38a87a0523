"""Paged decode attention as Triton kernels: split-KV ("flash decoding") in two stages.

Keys come in tiles of BLOCK_N positions, tile t holding [t * BLOCK_N, (t + 1) * BLOCK_N) (a function of
D alone). Stage 1, one program per (sequence, kv head, part), `parts` programs per sequence and kv
head: part p takes that sequence's tiles p, p + parts, p + 2 * parts, ... (counted from the tile of
its first key) with an online softmax over the query heads of its kv head (GQA, padded to 16 rows
for tl.dot), and writes its normalised partial output and log-sum-exp. Stage 2, one program per
(sequence, head): merges the sequence's parts, all at once, in a tree of a fixed shape.

Why parts, not splits of a fixed size: a decode step is latency-bound. With one program per 256-key
split, a 228-key context was one program walking 8 tiles one after the other (9.4 us a layer for a
single sequence on an H200, 20 us at 64 sequences: the step's largest kernel). Parts spread any
context's tiles over `parts` programs, so a short context is one tile deep, and the partial buffers
hold `parts` rows per head whatever the context length.

Batch invariance: the tiles sit at fixed key positions, `parts` is a constant (never a function of the
batch or of the block table's width), every block size is a function of D alone, a program reads only
its own sequence, and stage 2 reduces a [parts, D] tile whose shape is fixed: a row's output is
bitwise the same whatever the batch. No atomics.

Keys are gathered one slot at a time through the block table (slot = table[pos // block_size] *
block_size + pos % block_size), so any block size and any table (gaps, shared blocks) works, and the
caches need only a unit stride along D. Everything is computed in float32: K/V tiles are upcast after
the load, and the dots run as TF32 when q and the caches are 16-bit floats (a bf16/fp16 value is
exact in TF32, so q.K is exact products with fp32 sums; only the probabilities lose bits in P.V) and
as IEEE fp32 otherwise. Padding rows (seq_len 0) come out as zeros."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = math.log2(math.e)
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@triton.jit
def _first_key(seq_len, window):
    """The first position a query at seq_len - 1 attends."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def soft_cap_log2(s, cap_log2):
    """Scores already in log2 units (scaled by LOG2E) soft-capped at cap_log2 = softcap * LOG2E: the same
    as softcap * tanh(x / softcap) on the natural scores x, then scaled, written with exp for the
    interpreter and every backend (an overflow gives exactly +-cap)."""
    return cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / cap_log2) + 1.0))


@triton.jit
def _decode_part_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                        scale_log2, stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                        stride_table, num_heads, head_dim, block_size, window, cap_log2,
                        PARTS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = _first_key(seq_len, window)
    lo = (start // BLOCK_N + part) * BLOCK_N
    if lo < seq_len:  # else: this part has no tile; stage 2 reads only the parts that have one
        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        g_mask = g < GROUP
        d_mask = d < head_dim
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        table = table_ptr + b * stride_table

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(lo, seq_len, BLOCK_N * PARTS):  # every tile holds at least one key: m stays finite
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = (pos >= start) & (pos < seq_len)
            block = tl.load(table + pos // block_size, mask=n_mask, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
            kv_mask = n_mask[:, None] & d_mask[None, :]
            # V is loaded with K, before the softmax needs it: one memory round trip a tile, not two.
            k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if CAP:
                s = soft_cap_log2(s, cap_log2)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new

        row = (b * num_heads + heads) * PARTS + part  # part_lse [B, H, parts], part_out [B, H, parts, D]
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g_mask)
        tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], acc / l[:, None],
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, stride_ob, stride_oh,
                         num_heads, head_dim, window, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    start = _first_key(seq_len, window)
    tiles = tl.maximum(tl.cdiv(seq_len, BLOCK_N) - start // BLOCK_N, 0)  # 0 for a padding row
    p = tl.arange(0, PARTS)
    d = tl.arange(0, BLOCK_D)
    has = p < tiles
    d_mask = d < head_dim
    row = (b * num_heads + h) * PARTS + p
    lse = tl.load(part_lse_ptr + row, mask=has, other=float("-inf"))
    part = tl.load(part_out_ptr + row[:, None] * head_dim + d[None, :], mask=has[:, None] & d_mask[None, :],
                   other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(has, tl.exp2(lse - m), 0.0)
    l = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * part, 0)
    out = tl.where(l > 0.0, acc / tl.where(l > 0.0, l, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def dot_precision(*tensors: Tensor) -> str:
    """TF32 loses nothing when every operand is a 16-bit float; fp32 operands need IEEE."""
    return "tf32" if all(t.dtype in _SIXTEEN_BIT for t in tensors) else "ieee"


def decode_tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, num_warps): from D alone, so the arithmetic never depends on the batch.
    Chosen so that sm_90 builds keep everything in registers (ptxas: no spills)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d <= 64:
        return block_d, 32, 4
    return block_d, 32 if block_d <= 128 else 16, 8


def merge_warps(block_d: int) -> int:
    return 1 if block_d <= 128 else 2


def paged_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  seq_lens: Tensor, scale: float, window: int, parts: int, *,
                                  block_size: int, softcap: float = 0.0) -> Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    group = num_heads // kv_heads
    part_out = torch.empty(batch, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, parts, dtype=torch.float32, device=q.device)
    block_d, block_n, warps = decode_tiles(head_dim)
    _decode_part_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), num_heads, head_dim, block_size, window,
        softcap * LOG2E, PARTS=parts, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, PRECISION=dot_precision(q, k_cache, v_cache), CAP=softcap > 0, num_warps=warps)
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_heads, head_dim, window,
        PARTS=parts, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=merge_warps(block_d))
    return out
