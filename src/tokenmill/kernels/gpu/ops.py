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

# Paged decode attention's programs per (sequence, kv head) (kernels/gpu/decode_attention.py). 8 puts
# SmolLM2's 228-key benchmark context (8 tiles of 32 keys) one tile deep per program; a 4,096-key
# context is 16 tiles deep (the 256-key splits before were 8). A constant: a row's result depends on it.
DECODE_PARTS = 8

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
                           scale: float, window: int = 0, parts: int = DECODE_PARTS, *, block_size: int,
                           softcap: float = 0.0) -> Tensor:
    """q [B, H, D], one token per sequence at position seq_lens[b] - 1 (its K/V already written);
    -> [B, H, D] in q's dtype. Rows with seq_lens 0 are zeros. A row's output does not depend on B.
    parts: programs per sequence and kv head (a power of two; decode_attention.py), a test's knob.
    softcap > 0: scores soft-capped, softcap * tanh(s / softcap) (Gemma 2)."""
    block_tables = _check_attention(q, k_cache, v_cache, block_tables, q.shape[0], block_size, window)
    seq_lens = _check_index("seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != q.shape[0] or parts < 1 or parts & (parts - 1):
        raise ValueError(f"seq_lens must have {q.shape[0]} rows and parts be a power of two, got "
                         f"{tuple(seq_lens.shape)} and {parts}")
    impl = kernel_module("decode_attention").paged_decode_attention_triton if use_triton(q) else \
        references.paged_decode_attention_reference
    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, window, parts, block_size=block_size,
                softcap=softcap)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_q_lens: Tensor,
                            seq_lens: Tensor, scale: float, window: int = 0, *, block_size: int,
                            softcap: float = 0.0) -> Tensor:
    """q [T, H, D], S sequences' new rows packed (cu_q_lens [S+1]); sequence s's rows are positions
    seq_lens[s] - q_len .. seq_lens[s] - 1 (their K/V already written); causal. -> [T, H, D]."""
    seq_lens = _check_index("seq_lens", seq_lens, 1)
    cu_q_lens = _check_index("cu_q_lens", cu_q_lens, 1)
    block_tables = _check_attention(q, k_cache, v_cache, block_tables, seq_lens.shape[0], block_size, window)
    if cu_q_lens.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_q_lens must have {seq_lens.shape[0] + 1} entries, got {cu_q_lens.shape[0]}")
    impl = kernel_module("prefill_attention").paged_prefill_attention_triton if use_triton(q) else \
        references.paged_prefill_attention_reference
    return impl(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale, window, block_size=block_size,
                softcap=softcap)


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


# ---- the decoder layer's small ops: one kernel each on CUDA ---------------------------------------

def _rows_ok(*ts: Tensor | None) -> bool:
    """2-d, unit inner stride, one shape and dtype: what the row kernels address."""
    first = ts[0]
    return all(t is None or (t.dim() == 2 and t.shape == first.shape and t.dtype == first.dtype
                             and (t.shape[1] <= 1 or t.stride(1) == 1)) for t in ts)


def rms_norm(x: Tensor, weight: Tensor, eps: float, weight_f32: bool = False) -> Tensor:
    """RMSNorm of each row of x [T, dim]: weighted in float32 and rounded once (weight_f32, Gemma),
    or rounded to x's dtype before the weight multiplies (Llama). A new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_rms_norm(x, None, None, (weight, eps, weight_f32), out=out)
    return out


def residual_rms_norm(a: Tensor, residual: Tensor | None, pre: tuple | None, post: tuple | None, *,
                      out: Tensor | None = None) -> Tensor | None:
    """A block's residual step: residual += pre(a) (a itself when pre is None) in place, then returns
    post(residual) (None when post is None). pre/post: (weight, eps, weight_f32) as rms_norm's. With
    residual None: returns post(pre(a)) (rms_norm)."""
    if post is not None and out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if residual is None and post is None:
        raise ValueError("residual_rms_norm: nothing to do without a residual or a post norm")
    if use_triton(a) and _rows_ok(a, residual, out) and all(
            n is None or (n[0].shape == (a.shape[-1],) and n[0].is_contiguous()) for n in (pre, post)):
        kernel_module("norms").residual_norm_triton(a, residual, out, pre, post)
    else:
        references.residual_norm_reference(a, residual, out, pre, post)
    return out


def _rope_inputs_ok(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """What the rotary kernel addresses: heads [T, heads, D] with unit stride along D, a position per
    row, and two tables of one layout [max_positions, rope_dim] with an even rope_dim <= D."""
    return (x.dim() == 3 and x.stride(2) == 1 and positions.dim() == 1 and positions.shape[0] == x.shape[0]
            and cos.dim() == 2 and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(1) == 1
            and cos.shape[1] % 2 == 0 and cos.shape[1] <= x.shape[2])


def rope(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, head_norm: tuple | None = None) -> None:
    """Rotary embedding in place on qk [T, heads, head_dim] (q and k heads), half-split over the first
    cos.shape[-1] dims, from the float32 tables [max_positions, rope_dim] at positions (int64 [T]);
    head_norm (n_q_heads, q_weight, k_weight, eps): Gemma 3's per-head RMSNorm first."""
    if use_triton(qk) and _rope_inputs_ok(qk, positions, cos, sin):
        kernel_module("rotary").rope_triton(qk, positions.contiguous(), cos, sin, head_norm)
    else:
        references.rope_reference(qk, positions, cos, sin, head_norm)


def rope_kv_write(qkv: Tensor, n_q_heads: int, positions: Tensor, cos: Tensor, sin: Tensor, head_norm: tuple | None,
                  k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """rope() on the q and k heads of a step's projection qkv [T, n_q + 2 n_kv, D] in place, then
    kv_write() of its k heads (rotated) and v heads: one kernel on CUDA (a decode layer's)."""
    n_kv = (qkv.shape[1] - n_q_heads) // 2
    if qkv.dim() != 3 or n_q_heads < 1 or n_kv < 1 or n_q_heads + 2 * n_kv != qkv.shape[1]:
        raise ValueError(f"qkv must be [T, {n_q_heads} + 2 Hkv, D], got {tuple(qkv.shape)}")
    _check_caches(k_cache, v_cache)
    if k_cache.shape[0] != n_kv or k_cache.shape[2] != qkv.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold {n_kv} heads of {qkv.shape[2]}")
    slot_mapping = _check_index("slot_mapping", slot_mapping, 1)
    if use_triton(qkv) and _rope_inputs_ok(qkv, positions, cos, sin) and slot_mapping.shape[0] == qkv.shape[0]:
        kernel_module("rotary").rope_triton(qkv, positions.contiguous(), cos, sin, head_norm,
                                            (n_q_heads, n_kv, k_cache, v_cache, slot_mapping))
    else:
        references.rope_reference(qkv[:, :n_q_heads + n_kv], positions, cos, sin, head_norm)
        references.kv_write_reference(qkv[:, n_q_heads:n_q_heads + n_kv], qkv[:, n_q_heads + n_kv:], k_cache, v_cache,
                                      slot_mapping)


def gated_activation(gate_up: Tensor, activation: str) -> Tensor:
    """[T, 2F] -> act(gate) * up, [T, F]; activation "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")
    gelu = activation == "gelu_tanh"
    if use_triton(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1:
        return kernel_module("activations").gated_triton(gate_up, gelu)
    return references.gated_reference(gate_up, gelu)
