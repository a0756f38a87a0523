"""Paged prefill ("extend") attention as a Triton kernel: the packed new rows of S sequences attend
their own sequence's cached prefix and, causally, each other, all read from the paged cache (the
caller has written the new rows' K/V first). Sliding windows and GQA as in decode.

One program per (query tile, head). Tiles are BLOCK_M rows of one sequence, counted from that
sequence's first row, and numbered so that no host sync is needed: sequence s's tiles start at
number cu_q_lens[s] // BLOCK_M + s, which leaves room for ceil(q_len / BLOCK_M) tiles before the next
sequence's, so a grid of T // BLOCK_M + S programs covers every tile and a program finds its sequence
by binary search over cu_q_lens (programs past a sequence's last row do nothing). Since tiles start at
a sequence's own first row, a row's result never depends on the other sequences in the batch.

Each tile walks the keys from the first one its earliest row may see (0, or that row's window start)
to its last row's position, gathering slots through the block table, with an online softmax in
float32; the dots run as in decode_attention (TF32 for 16-bit inputs, IEEE fp32 otherwise)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenmill.kernels.gpu.decode_attention import LOG2E, dot_precision, soft_cap_log2


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, cu_ptr, lens_ptr, scale_log2,
                    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ot, stride_oh,
                    stride_table, num_seqs, head_dim, block_size, window, cap_log2,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, CAP: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # The last sequence whose first tile number is <= tile.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_ptr + seq)
    q_end = tl.load(cu_ptr + seq + 1)
    seq_len = tl.load(lens_ptr + seq)
    row0 = q_start + (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_end
    q_pos = seq_len - q_end + rows  # a new row's position: seq_len - q_len + (row - q_start)

    last_pos = seq_len - q_end + tl.minimum(row0 + BLOCK_M, q_end) - 1
    k_lo = tl.where(window > 0, tl.maximum(seq_len - q_end + row0 - window + 1, 0), 0)
    k_hi = tl.where(row0 < q_end, last_pos + 1, k_lo)  # no rows here: no keys

    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_offs = rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    table = table_ptr + seq.to(tl.int64) * stride_table

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = k_pos < k_hi
        block = tl.load(table + k_pos // block_size, mask=n_mask, other=0)
        slot = block.to(tl.int64) * block_size + k_pos % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if CAP:
            s = soft_cap_log2(s, cap_log2)
        allowed = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    o_offs = rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def prefill_tiles(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps) from D alone: the largest tiles an sm_90 build keeps in
    registers (ptxas: ~250 registers, no spills)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d <= 64:
        return block_d, 64, 32, 4
    if block_d <= 128:
        return block_d, 64, 32, 8
    return block_d, 32, 16, 8


def paged_prefill_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                   cu_q_lens: Tensor, seq_lens: Tensor, scale: float, window: int = 0, *,
                                   block_size: int, block_m: int | None = None,
                                   block_n: int | None = None, softcap: float = 0.0) -> Tensor:
    """block_m / block_n override the tile sizes (tests use small ones to cross tile edges)."""
    tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tokens == 0 or num_seqs == 0:
        return out
    block_d, tile_m, tile_n, warps = prefill_tiles(head_dim)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    _prefill_kernel[(tokens // block_m + num_seqs, num_heads)](
        q, k_cache, v_cache, out, block_tables, cu_q_lens, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), num_seqs, head_dim, block_size, window,
        softcap * LOG2E, GROUP=num_heads // k_cache.shape[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=dot_precision(q, k_cache, v_cache), CAP=softcap > 0, num_warps=warps)
    return out
