"""The KV write as a Triton kernel: a step's new K and V rows [T, Hkv, D] scattered into the paged
caches [Hkv, num_slots, D] at their slots. A row whose slot is < 0 (a padding row of a CUDA graph
bucket) writes nothing. One program per (row, kv head)."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kch, stride_kcs, stride_vch, stride_vcs,
                     head_dim, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (d < head_dim) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + h * stride_kch + slot * stride_kcs + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + h * stride_vch + slot * stride_vcs + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _kv_write_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        head_dim, BLOCK_D=triton.next_power_of_2(head_dim))
