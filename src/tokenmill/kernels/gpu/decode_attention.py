"""Paged decode attention as Triton kernels: split-KV ("flash decoding") in two stages.

Stage 1, one program per (sequence, kv head, split): the query heads of that kv head (GQA, padded to
16 rows for tl.dot) attend one split of `split_size` keys with an online softmax; it writes the
split's normalised partial output and its log-sum-exp. Stage 2, one program per (sequence, head):
merges that sequence's splits in split order.

Batch invariance: splits sit at fixed key positions (multiples of split_size), every block size is a
function of D alone, a program reads only its own sequence, and stage 2 loops over the sequence's
own splits, never over the grid's (which depends on the block table's width), so a row's output is
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
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                         scale_log2, stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                         stride_table, num_heads, num_splits, head_dim, block_size, window, split_size,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    j = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = _first_key(seq_len, window)
    split = start // split_size + j
    lo = tl.maximum(split * split_size, start)
    hi = tl.minimum(split * split_size + split_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):  # every tile holds at least one key: m stays finite
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        block = tl.load(table_ptr + b * stride_table + pos // block_size, mask=n_mask, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    nonempty = l > 0.0  # an empty split (past the sequence's end) is never read; keep it finite anyway
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    row = (b * num_heads + heads) * num_splits + j  # part_lse [B, H, splits], part_out [B, H, splits, D]
    # A split past the sequence's end (the grid covers the longest context) stores nothing: stage 2
    # reads only the sequence's own splits, and at batch 256 the empty ones' stores were most of the
    # kernel's memory traffic.
    keep = g_mask & (lo < hi)
    tl.store(part_lse_ptr + row, lse, mask=keep)
    tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], out, mask=keep[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, stride_ob, stride_oh,
                         num_heads, num_splits, head_dim, window, split_size, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    start = _first_key(seq_len, window)
    first = start // split_size
    count = tl.maximum(tl.cdiv(seq_len, split_size) - first, 0)  # 0 for a padding row
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row0 = (b * num_heads + h) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(0, count):  # in split order, over this sequence's splits only
        lse = tl.load(part_lse_ptr + row0 + j)
        part = tl.load(part_out_ptr + (row0 + j) * head_dim + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        acc = acc * alpha + part * beta
        l = l * alpha + beta
        m = m_new
    out = tl.where(l > 0.0, acc / tl.where(l > 0.0, l, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def dot_precision(*tensors: Tensor) -> str:
    """TF32 loses nothing when every operand is a 16-bit float; fp32 operands need IEEE."""
    return "tf32" if all(t.dtype in _SIXTEEN_BIT for t in tensors) else "ieee"


def decode_tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, num_warps): from D alone, so the arithmetic never depends on the batch.
    Chosen so that sm_90 builds keep everything in registers (ptxas: 148-175 registers, no spills)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d <= 64:
        return block_d, 32, 4
    return block_d, 32 if block_d <= 128 else 16, 8


def merge_warps(block_d: int) -> int:
    return 1 if block_d <= 128 else 2


def decode_splits(max_context: int, split_size: int, window: int) -> int:
    """Splits per sequence the grid holds: all of a full table's, or as many as a window can touch."""
    splits = triton.cdiv(max_context, split_size)
    if window > 0:
        splits = min(splits, triton.cdiv(window - 1, split_size) + 1)
    return max(splits, 1)


def paged_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  seq_lens: Tensor, scale: float, window: int = 0, split_size: int = 256, *,
                                  block_size: int) -> Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    group = num_heads // kv_heads
    num_splits = decode_splits(block_tables.shape[1] * block_size, split_size, window)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d, block_n, warps = decode_tiles(head_dim)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), num_heads, num_splits, head_dim,
        block_size, window, split_size,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=dot_precision(q, k_cache, v_cache), num_warps=warps)
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_heads, num_splits, head_dim,
        window, split_size, BLOCK_D=block_d, num_warps=merge_warps(block_d))
    return out
