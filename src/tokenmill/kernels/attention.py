"""Paged attention over the head-major KV cache, and the write that fills it, as compiled kernels
(csrc/paged_attention.cpp, csrc/kv_write.cpp) with PyTorch references of the same signatures.

A step's batch is a flat run of T query rows from S sequences: sequence s owns rows
cu_rows[s] .. cu_rows[s+1]-1 at positions start_pos[s], start_pos[s]+1, ... (a decode row is a
chunk of one). A row at position p attends its own sequence's keys 0..p (with window > 0, only
p-window+1..p), which the caller has already written to the cache; query head h reads kv head
h // (H / Hkv). Keys are found through block_tables[s] (slot = block * block_size + offset). With
softcap > 0 each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).

The compiled kernel is batch invariant: a row's output is bitwise the same however rows are grouped
into chunks and steps, and for any thread count (per variant; variants differ in the last bits).

Cache dtypes: float32, float16, bfloat16, or int8 with one float32 scale per (kv head, slot). float16
keeps 3 more mantissa bits than bfloat16 (K/V values of these models stay far inside its range), so it
is the default for GGUF models, as in llama.cpp. Int8 is an
approximation: each (token, head) row is quantised symmetrically to absmax/127 on write, so keys and
values carry up to half a step (absmax/254) of rounding error each; attention itself is fp32."""
from __future__ import annotations

import torch

from tokenmill.kernels import native

# Cache dtype -> the kernels' cache_type code (csrc/kernels.h).
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float16: 3}


def _cache_type(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> int:
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_TYPES:
        raise TypeError(f"K/V caches must share one of {list(CACHE_TYPES)}, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3:
        raise ValueError(f"caches must both be [Hkv, slots, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if k_cache.dtype == torch.int8:
        for s in (k_scale, v_scale):
            if s.dtype != torch.float32 or s.shape != k_cache.shape[:2] or not s.is_contiguous():
                raise ValueError("int8 caches need contiguous float32 scales [Hkv, slots]")
    return CACHE_TYPES[k_cache.dtype]


def _dequantize(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[Hkv, len(slots), D] float32."""
    x = cache[:, slots].float()
    return x * scale[:, slots, None] if cache.dtype == torch.int8 else x


# ---- paged attention ---------------------------------------------------------------------------

def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                              v_scale: torch.Tensor, cu_rows: torch.Tensor, start_pos: torch.Tensor,
                              block_tables: torch.Tensor, block_size: int, scale: float, window: int = 0,
                              softcap: float = 0.0) -> torch.Tensor:
    """Plain PyTorch, one sequence at a time, everything in float32 (the tests' oracle)."""
    t, h, d = q.shape
    h_kv = k_cache.shape[0]
    g = h // h_kv
    out = torch.empty(t, h, d, dtype=torch.float32)
    cu, starts = cu_rows.tolist(), start_pos.tolist()
    for s in range(len(starts)):
        r0, r1 = cu[s], cu[s + 1]
        if r1 == r0:
            continue
        first, last = starts[s], starts[s] + (r1 - r0) - 1
        lo = max(0, first - window + 1) if window > 0 else 0
        pos = torch.arange(lo, last + 1)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = _dequantize(k_cache, k_scale, slots)                                  # [Hkv, L, D]
        v = _dequantize(v_cache, v_scale, slots)
        qs = q[r0:r1].float().view(r1 - r0, h_kv, g, d).permute(1, 0, 2, 3)      # [Hkv, n, G, D]
        scores = torch.einsum("hngd,hld->hngl", qs, k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(first, last + 1)[:, None]
        visible = pos[None, :] <= qpos
        if window > 0:
            visible &= pos[None, :] > qpos - window
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
        o = torch.einsum("hngl,hld->hngd", torch.softmax(scores, dim=-1), v)
        out[r0:r1] = o.permute(1, 0, 2, 3).reshape(r1 - r0, h, d)
    return out


def _paged_attention_native(mod, q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables,
                            block_size, scale, window, softcap):
    t, h, d = q.shape
    cache_type = _cache_type(k_cache, v_cache, k_scale, v_scale)
    if q.dtype != torch.float32 or q.stride(2) != 1:
        q = q.float().contiguous()
    cu_rows, start_pos = cu_rows.to(torch.int32).contiguous(), start_pos.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    h_kv, slots, _ = k_cache.shape
    mod.paged_attention(q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), t, h, d, k_cache.data_ptr(),
                        v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), cache_type, h_kv, slots,
                        cu_rows.data_ptr(), start_pos.data_ptr(), start_pos.shape[0], block_tables.data_ptr(),
                        block_tables.shape[1] if block_tables.dim() == 2 else 0, block_size, scale, window, softcap)
    return out


def _paged_attention_impl(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables, block_size, scale,
                          window, softcap):
    mod = native.module()
    if mod is None:
        return paged_attention_reference(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables,
                                         block_size, scale, window, softcap)
    return _paged_attention_native(mod, q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables,
                                   block_size, scale, window, softcap)


# Named apart from model/attention.py's "tokenmill::paged_attention" (the step-level op it wraps today).
@torch.library.custom_op("tokenmill::paged_attention_kernel", mutates_args=())
def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, cu_rows: torch.Tensor, start_pos: torch.Tensor,
                       block_tables: torch.Tensor, block_size: int, scale: float, window: int,
                       softcap: float) -> torch.Tensor:
    return _paged_attention_impl(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables, block_size,
                                 scale, window, softcap)


@paged_attention_op.register_fake
def _paged_attention_shape(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables, block_size, scale,
                           window, softcap):
    return q.new_empty(q.shape, dtype=torch.float32)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, cu_rows: torch.Tensor, start_pos: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: float32 [T, H, D] (token and head strides free, D contiguous); k_cache/v_cache: [Hkv, slots, D]
    float32, bfloat16 or int8 (contiguous); k_scale/v_scale: float32 [Hkv, slots] for int8 caches, else
    empty; cu_rows: int32 [S+1]; start_pos: int32 [S]; block_tables: int32 [S, W] (entries past a
    sequence's last block are never read). D: a multiple of 16. Returns float32 [T, H, D]."""
    if torch.compiler.is_compiling():
        return paged_attention_op(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables,
                                  block_size, scale, window, softcap)
    return _paged_attention_impl(q, k_cache, v_cache, k_scale, v_scale, cu_rows, start_pos, block_tables, block_size,
                                 scale, window, softcap)


# ---- writing K/V -------------------------------------------------------------------------------

def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain PyTorch; the compiled write matches it bit for bit."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, sc in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        x = x.float().transpose(0, 1)                                   # [Hkv, n, D]
        if cache.dtype == torch.int8:
            s = x.abs().amax(-1) / 127                                   # [Hkv, n]
            qx = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp_(-127, 127)
            cache[:, slots] = qx.to(torch.int8)
            sc[:, slots] = s
        else:
            cache[:, slots] = x.to(cache.dtype)


def _write_kv_impl(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    mod = native.module()
    if mod is None:
        write_kv_reference(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    cache_type = _cache_type(k_cache, v_cache, k_scale, v_scale)
    if k.dtype != torch.float32 or k.stride(2) != 1:
        k = k.float().contiguous()
    if v.dtype != torch.float32 or v.stride(2) != 1:
        v = v.float().contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    t, h_kv, d = k.shape
    mod.write_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), t, h_kv, d,
                 k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), cache_type,
                 k_cache.shape[1], slot_mapping.data_ptr())


@torch.library.custom_op("tokenmill::write_kv", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def write_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _write_kv_impl(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


@write_kv_op.register_fake
def _write_kv_shape(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    return None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: float32 [T, Hkv, D] (D contiguous); slot_mapping: int64 [T] (negative = skip the token).
    Writes in place, converting to the cache dtype: bfloat16 rounds to nearest even; int8 stores
    round(x / s) with s = absmax / 127 per (token, head), and s in k_scale/v_scale [Hkv, slots]."""
    if torch.compiler.is_compiling():
        write_kv_op(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    else:
        _write_kv_impl(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
