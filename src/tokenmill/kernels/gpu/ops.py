"""The GPU ops as the model runner calls them: shapes checked, then the Triton kernel (CUDA tensors)
or the PyTorch reference (anything else; see dispatch). The checks read shapes, dtypes and strides
only, never tensor values, so the ops can be captured in a CUDA graph (no host sync). Values the
caller guarantees: slots inside the cache, seq_lens[b] <= block_tables.shape[1] * block_size, block
ids inside the cache, cu_q_lens non-decreasing from 0 to T with q_len <= seq_len."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels.gpu import references
from tokenmill.kernels.gpu.dispatch import kernel_module, use_triton

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _unit_last(name: str, t: Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride along its last dim, got strides {t.stride()}")


def _check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [Hkv, slots, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"caches must share one of {CACHE_DTYPES}, got {k_cache.dtype} and {v_cache.dtype}")
    _unit_last("k_cache", k_cache)
    _unit_last("v_cache", v_cache)


def _check_index(name: str, t: Tensor, dims: int) -> Tensor:
    if t.dtype not in INDEX_DTYPES or t.dim() != dims:
        raise TypeError(f"{name} must be a {dims}-d int32 or int64 tensor, got {t.dtype} {tuple(t.shape)}")
    return t.contiguous()


def _check_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, rows: int,
                     block_size: int, window: int) -> Tensor:
    _check_caches(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"q must be [rows, H, D] with D = {k_cache.shape[2]}, got {tuple(q.shape)}")
    if q.dtype not in CACHE_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[0]} kv heads")
    _unit_last("q", q)
    block_tables = _check_index("block_tables", block_tables, 2)
    if block_tables.shape[0] != rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {rows} sequences")
    if block_size < 1 or window < 0:
        raise ValueError(f"block_size must be >= 1 and window >= 0, got {block_size} and {window}")
    return block_tables


def kv_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place: row t of k, v [T, Hkv, D] goes to slot slot_mapping[t] of each cache; slot < 0 skips."""
    _check_caches(k_cache, v_cache)
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (k_cache.shape[0], k_cache.shape[2]):
        raise ValueError(f"k, v must be [T, {k_cache.shape[0]}, {k_cache.shape[2]}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    slot_mapping = _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} rows")
    _unit_last("k", k)
    _unit_last("v", v)
    if use_triton(k):
        kernel_module("cache_write").kv_write_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        references.kv_write_reference(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           scale: float, window: int = 0, split_size: int = 256, *, block_size: int) -> Tensor:
    """q [B, H, D], one token per sequence at position seq_lens[b] - 1 (its K/V already written);
    -> [B, H, D] in q's dtype. Rows with seq_lens 0 are zeros. A row's output does not depend on B."""
    block_tables = _check_attention(q, k_cache, v_cache, block_tables, q.shape[0], block_size, window)
    seq_lens = _check_index("seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != q.shape[0] or split_size < 1:
        raise ValueError(f"seq_lens must have {q.shape[0]} rows and split_size >= 1, got "
                         f"{tuple(seq_lens.shape)} and {split_size}")
    impl = kernel_module("decode_attention").paged_decode_attention_triton if use_triton(q) else \
        references.paged_decode_attention_reference
    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, window, split_size, block_size=block_size)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_q_lens: Tensor,
                            seq_lens: Tensor, scale: float, window: int = 0, *, block_size: int) -> Tensor:
    """q [T, H, D], S sequences' new rows packed (cu_q_lens [S+1]); sequence s's rows are positions
    seq_lens[s] - q_len .. seq_lens[s] - 1 (their K/V already written); causal. -> [T, H, D]."""
    seq_lens = _check_index("seq_lens", seq_lens, 1)
    cu_q_lens = _check_index("cu_q_lens", cu_q_lens, 1)
    block_tables = _check_attention(q, k_cache, v_cache, block_tables, seq_lens.shape[0], block_size, window)
    if cu_q_lens.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_q_lens must have {seq_lens.shape[0] + 1} entries, got {cu_q_lens.shape[0]}")
    impl = kernel_module("prefill_attention").paged_prefill_attention_triton if use_triton(q) else \
        references.paged_prefill_attention_reference
    return impl(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale, window, block_size=block_size)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """In place: logits [B, V] get -inf where bitmask int32 [B, ceil(V/32)] has a clear bit."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a 2-d float tensor, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise TypeError(f"bitmask must be int32 [{logits.shape[0]}, words], got {bitmask.dtype} "
                        f"{tuple(bitmask.shape)}")
    _unit_last("logits", logits)
    if use_triton(logits):
        kernel_module("token_mask").apply_token_bitmask_triton(logits, bitmask.contiguous())
    else:
        references.apply_token_bitmask_reference(logits, bitmask)
