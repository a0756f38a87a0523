"""Plain PyTorch references of the GPU ops, with the dispatchers' signatures: the tests' oracle, and
what runs when the Triton kernels cannot (CPU tensors, no triton). They work on any device, loop over
sequences in Python and compute attention in float32; they read the caches through slots only, so
block tables with gaps, shared blocks and strided (non-contiguous) caches all mean the same here as
in the kernels.

Conventions (docs: /work/notes/gpu_interface.md): a cache is [Hkv, num_slots, D], slot =
block_id * block_size + offset; query head h reads kv head h // (H // Hkv); a query at position p
attends keys 0..p, or with window > 0 only p-window+1..p; softcap > 0 turns each scaled score s into
softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
from __future__ import annotations

import torch
from torch import Tensor


def kv_write_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place: k_cache[:, slot_mapping[t]] = k[t] (and v), skipping rows whose slot is < 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(device=k_cache.device, dtype=torch.long)
    k_cache[:, slots] = k[keep].transpose(0, 1).to(k_cache.dtype)
    v_cache[:, slots] = v[keep].transpose(0, 1).to(v_cache.dtype)


def gather_keys(cache: Tensor, block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """[Hkv, len(positions), D] float32: one sequence's cache rows at the given positions."""
    table = block_table.long()
    positions = positions.to(table.device)
    slots = table[positions // block_size] * block_size + positions % block_size
    return cache[:, slots].float()


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
    """q [n, H, D] float32, k/v [Hkv, m, D] float32, allowed bool [n, m] -> [n, H, D] float32."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [H, m, D]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hmd->hnm", q, k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnm,hmd->nhd", torch.softmax(scores, dim=-1), v)


def _key_range(last_pos: int, window: int) -> int:
    """The first key position a query at last_pos attends."""
    return max(0, last_pos - window + 1) if window > 0 else 0


def paged_decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                     seq_lens: Tensor, scale: float, window: int = 0, parts: int = 8, *,
                                     block_size: int, softcap: float = 0.0) -> Tensor:
    """q [B, H, D]: row b is the token at position seq_lens[b] - 1; out [B, H, D] in q's dtype.
    parts only shapes the kernel's work; the reference attends all keys at once."""
    del parts
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue  # a padding row
        positions = torch.arange(_key_range(seq_len - 1, window), seq_len)
        k = gather_keys(k_cache, block_tables[b], positions, block_size)
        v = gather_keys(v_cache, block_tables[b], positions, block_size)
        allowed = torch.ones(1, len(positions), dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b:b + 1].float(), k, v, allowed, scale, softcap)[0]
    return out.to(q.dtype)


def paged_prefill_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                      cu_q_lens: Tensor, seq_lens: Tensor, scale: float, window: int = 0, *,
                                      block_size: int, softcap: float = 0.0) -> Tensor:
    """q [T, H, D]: sequence s's rows cu_q_lens[s]..cu_q_lens[s+1]-1 are its positions
    seq_lens[s] - q_len .. seq_lens[s] - 1; causal. out [T, H, D] in q's dtype."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_q_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        r0, r1 = cu[s], cu[s + 1]
        if r1 == r0:
            continue
        q_pos = torch.arange(seq_len - (r1 - r0), seq_len)
        k_pos = torch.arange(_key_range(int(q_pos[0]), window), seq_len)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        k = gather_keys(k_cache, block_tables[s], k_pos, block_size)
        v = gather_keys(v_cache, block_tables[s], k_pos, block_size)
        out[r0:r1] = _attend(q[r0:r1].float(), k, v, allowed.to(q.device), scale, softcap)
    return out.to(q.dtype)


def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """int32 [B, words] -> bool [B, vocab], True where the token is allowed (bit t of word t // 32,
    little-endian); tokens past the mask's words are not allowed."""
    covered = min(vocab, 32 * bitmask.shape[1])
    tokens = torch.arange(covered, device=bitmask.device)
    bits = (bitmask[:, tokens // 32] >> (tokens % 32).to(torch.int32)) & 1
    allowed = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool, device=bitmask.device)
    allowed[:, :covered] = bits.bool()
    return allowed


def apply_token_bitmask_reference(logits: Tensor, bitmask: Tensor) -> None:
    """In place: logits[b, t] = -inf where bit t of bitmask[b] is clear."""
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))


# ---- the decoder layer's small ops (norms.py, rotary.py, activations.py) --------------------------

def _norm_reference(x: Tensor, weight: Tensor, eps: float, weight_f32: bool) -> Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_f32:
        return (y * weight.float()).to(x.dtype)
    return (weight * y.to(x.dtype)).to(x.dtype)


def residual_norm_reference(a: Tensor, residual: Tensor | None, out: Tensor | None, pre: tuple | None,
                            post: tuple | None) -> None:
    """out = post(residual += pre(a)), each step optional (pre/post: (weight, eps, weight_f32)); in place."""
    x = a if pre is None else _norm_reference(a, *pre)
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    if post is not None:
        out.copy_(_norm_reference(x, *post))


def rope_reference(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, head_norm: tuple | None = None) -> None:
    """Rotary embedding in place on qk [T, heads, head_dim]; head_norm (n_q_heads, q_weight, k_weight,
    eps): Gemma 3's RMSNorm of each head first (weights in float32)."""
    from tokenmill.kernels.fused import head_rms_norm_rope_reference, rope_qk_reference

    if head_norm is None:
        rope_qk_reference(qk, positions, cos, sin)
    else:
        n_q, q_w, k_w, eps = head_norm
        head_rms_norm_rope_reference(qk, n_q, q_w, k_w, eps, positions, cos, sin)


def gated_reference(gate_up: Tensor, gelu: bool) -> Tensor:
    """[T, 2F] -> act(gate) * up [T, F]: silu, or tanh GELU."""
    from tokenmill.kernels.fused import gelu_tanh_mul_reference, silu_mul_reference

    return (gelu_tanh_mul_reference if gelu else silu_mul_reference)(gate_up)
