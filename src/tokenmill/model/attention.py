"""Attention over the paged KV cache in PyTorch, and the metadata that describes one step's batch
to it: the path of bf16 activations, and of every mode when the compiled core is absent. With the
core and float32 activations (gguf, fp32), every row goes through the native kernel instead
(model/paged_batch.py).

A batch is a flat run of tokens from many sequences. Each sequence contributes a contiguous chunk of
`num_new` query tokens whose keys are its first `num_cached + num_new` positions, stored in the blocks
its block table names.

The cache is head-major, [kv_heads, slots, head_dim], so gathering a sequence's whole blocks yields
a contiguous [kv_heads, tokens, head_dim] tensor. Single-token chunks (decodes) are attended together:
one gather of all their blocks, then grouped-query attention as two batched matmuls, which on CPU
runs several times faster than scaled_dot_product_attention's masked decode path. Longer chunks
(prefill) get one scaled_dot_product_attention call each, or from PIECE_FROM tokens up, matmuls
over query pieces (causal_pieces); a chunk with no earlier context attends to its own fresh K/V
without touching the cache."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ChunkSpec:
    """What the batch builder says about one sequence's share of a step."""
    block_table: Sequence[int]
    num_cached: int  # tokens already in the cache before this step (the chunk's first position)
    num_new: int     # query tokens this step


@dataclass
class DecodeGroup:
    rows: torch.Tensor | slice  # rows of the flat batch holding single-token chunks
    block_ids: torch.Tensor     # [B * max_blocks] each sequence's blocks, padded with block 0
    num_seqs: int
    max_blocks: int
    mask: torch.Tensor | None   # [1, B, 1, max_blocks * block_size] True = attend; None if nothing is padding


@dataclass
class PrefillChunk:
    start: int
    end: int
    block_ids: torch.Tensor | None  # blocks holding the context; None = no earlier context (use fresh K/V)
    num_kv: int                     # keys attended: num_cached + num_new
    mask: torch.Tensor | None       # [q, num_kv] offset-causal for SDPA; None: plain causal, or in pieces
    in_pieces: bool = False         # attended by causal_pieces (PIECE_FROM queries or more), not SDPA


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    block_size: int
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    chunks: Sequence[ChunkSpec] = ()  # what it was built from, for with_window
    _windowed: dict = field(default_factory=dict, repr=False)

    def with_window(self, window: int) -> "AttentionMetadata":
        """The same batch for a sliding-window layer (Gemma 3's local layers): itself while no
        sequence is longer than the window, else a variant whose masks also hide the keys that fell
        out of it, built once per step and shared by every such layer."""
        if all(c.num_cached + c.num_new <= window for c in self.chunks):
            return self
        if window not in self._windowed:
            self._windowed[window] = AttentionMetadata.build(self.chunks, self.block_size, window)
        return self._windowed[window]

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int, window: int | None = None) -> "AttentionMetadata":
        """window: also hide keys more than `window` positions before their query (see with_window)."""
        slot_mapping: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for c in chunks:
            total = c.num_cached + c.num_new
            num_blocks = -(-total // block_size)
            if len(c.block_table) < num_blocks:
                raise ValueError(f"block table covers {len(c.block_table) * block_size} tokens, chunk needs {total}")
            table = c.block_table
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(c.num_cached, total))
            if c.num_new == 1:
                decode_rows.append(row)
                decode_tables.append(list(table[:num_blocks]))
                decode_lens.append(total)
            else:
                windowed = window is not None and total > window
                # causal_pieces masks only causally; a windowed chunk takes SDPA with its band mask.
                in_pieces = c.num_new >= PIECE_FROM and not windowed
                blocks = torch.as_tensor(table[:num_blocks]) if c.num_cached else None
                mask = None
                if windowed or (c.num_cached and not in_pieces):
                    keys, queries = torch.arange(total).unsqueeze(0), torch.arange(c.num_cached, total).unsqueeze(1)
                    mask = keys <= queries
                    if windowed:
                        mask &= keys > queries - window
                prefills.append(PrefillChunk(row, row + c.num_new, blocks, total, mask, in_pieces))
            row += c.num_new
        decode = None
        if decode_rows:
            n = len(decode_rows)
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            width = max_blocks * block_size
            mask = None
            if any(length != width for length in decode_lens) or (window is not None and max(decode_lens) > window):
                keys, lens = torch.arange(width).unsqueeze(0), torch.as_tensor(decode_lens).unsqueeze(1)
                mask = keys < lens
                if window is not None:
                    mask &= keys >= lens - window
                mask = mask[None, :, None, :]
            contiguous = decode_rows == list(range(decode_rows[0], decode_rows[0] + n))
            rows = slice(decode_rows[0], decode_rows[0] + n) if contiguous else torch.as_tensor(decode_rows)
            decode = DecodeGroup(rows, torch.as_tensor(padded).view(-1), n, max_blocks, mask)
        return cls(torch.as_tensor(slot_mapping, dtype=torch.long), block_size, decode, prefills, chunks)


@dataclass
class GraphDecodeMeta:
    """A decode-only batch described by tensors alone, for the compiled decode step
    (model/decode_graph.py): every row is one sequence's single new token."""
    slot_mapping: torch.Tensor  # [B] slot each new token's K/V is written to
    slot_index: torch.Tensor    # [B, W] cache slot of each key position (padding points at block 0)
    mask: torch.Tensor          # [1, B, 1, W] True = attend
    lens: torch.Tensor | None = None  # [B] keys per sequence

    def with_window(self, window: int) -> "GraphDecodeMeta":
        """For a sliding-window layer: also hide keys more than `window` positions back (inside the
        graph, so it costs one fused comparison)."""
        pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
        recent = (pos.unsqueeze(0) >= (self.lens - window).unsqueeze(1))[None, :, None, :]
        return GraphDecodeMeta(self.slot_mapping, self.slot_index, self.mask & recent, self.lens)

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_ids: torch.Tensor, lens: torch.Tensor,
              block_size: int) -> "GraphDecodeMeta":
        """block_ids: [B, max_blocks] padded block tables; lens: [B] keys per sequence."""
        width = block_ids.shape[1] * block_size
        pos = torch.arange(width, device=block_ids.device)
        slot_index = block_ids[:, pos // block_size] * block_size + pos % block_size
        mask = (pos.unsqueeze(0) < lens.unsqueeze(1))[None, :, None, :]
        return cls(slot_mapping, slot_index, mask, lens)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention scores and logits); scores as they are for cap 0."""
    return torch.tanh(scores / cap).mul_(cap) if cap > 0 else scores


def fused_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: GraphDecodeMeta,
                           scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D], written for inductor: the slot gather sits inside the two
    reductions, which inductor fuses into single loops over the cache, so no gathered copy of K/V is
    ever made (the eager path's gather copied ~8 MB per layer at 64 sequences). In eager mode this
    form would materialise [Hkv, B, G, W, D]; eager decodes use decode_attention."""
    b, h, d = q.shape
    h_kv = k_cache.shape[0]
    scale = d ** -0.5 if scale is None else scale
    qg = q.view(b, h_kv, h // h_kv, d).transpose(0, 1).float()                       # [Hkv, B, G, D]
    k = k_cache[:, meta.slot_index]                                                   # [Hkv, B, W, D]
    scores = soft_cap((qg.unsqueeze(3) * k.unsqueeze(2).float()).sum(-1) * scale, softcap)  # [Hkv, B, G, W]
    probs = torch.softmax(scores.masked_fill(~meta.mask, float("-inf")), dim=-1)
    v = v_cache[:, meta.slot_index]
    out = (probs.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2)                      # [Hkv, B, G, D]
    return out.to(q.dtype).transpose(0, 1).reshape(b, h, d)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Hkv, slots, D] cache -> [Hkv, len(block_ids) * block_size, D], contiguous."""
    h, slots, d = cache.shape
    return cache.view(h, slots // block_size, block_size * d).index_select(1, block_ids).view(h, -1, d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                     block_size: int, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]."""
    b, h, d = q.shape
    h_kv = k_cache.shape[0]
    k = _gather_blocks(k_cache, g.block_ids, block_size).view(h_kv, b, -1, d)   # [Hkv, B, L, D]
    v = _gather_blocks(v_cache, g.block_ids, block_size).view(h_kv, b, -1, d)
    qg = q.view(b, h_kv, h // h_kv, d).transpose(0, 1)                          # [Hkv, B, G, D]
    # Scores in float32, as the compiled decode graph and flash SDPA compute them: a bf16 matmul's
    # output rounds them, which gave 4-5x the error at realistic sizes (and a decode row's result
    # would then depend on whether its step also held a prompt chunk).
    scores = soft_cap(torch.matmul(qg.float(), k.float().transpose(-1, -2)).mul_(scale), softcap)  # [Hkv, B, G, L]
    if g.mask is not None:
        scores.masked_fill_(~g.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, h, d)


# Queries per piece of a long prefill chunk, and the chunk length from which pieces replace SDPA.
# With float32 scores, pieces run at SDPA's speed from 512 queries (0.99-1.05x, same engine,
# alternating) but 5-7% slower at 256; their prefill logits are a little closer to fp32's (mean
# error 0.080 vs 0.092 on 64 corpus prompts of 512 tokens).
PIECE, PIECE_FROM = 128, 512


@functools.lru_cache(maxsize=8)
def _keys_after_query(group: int) -> torch.Tensor:
    """[PIECE * group, PIECE]: True where a piece's diagonal key comes after the row's query.
    Rows are (query, group member) pairs, as causal_pieces lays them out."""
    return torch.ones(PIECE, PIECE, dtype=torch.bool).triu_(1).repeat_interleave(group, 0)


def causal_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
                  softcap: float = 0.0) -> torch.Tensor:
    """Causal grouped-query attention of a chunk whose queries are the last q.shape[0] of the
    k.shape[1] keys: q [n, H, D] (the batch's token-major rows), k/v [Hkv, L, D]; writes and
    returns out [n, H, D].

    CPU flash SDPA manages about 30 GF/s on this shape (head_dim 64, 3 kv heads) at 512 tokens. Cut
    into PIECE-query slices, each slice is two plain matmuls over the keys it can see plus a
    softmax, masked only on its diagonal square: at 512 tokens a fifth of what it computes is
    masked away, but the matmuls run near the machine's speed. A kv head's query rows are
    ordered (token, group member), so every piece is a contiguous run of rows.

    Precision as flash SDPA's: scores and softmax in float32, probabilities rounded to the input
    dtype for the matmul with V. Scores rounded to bf16 (a bf16 matmul's output) ran the piece 1.5x
    faster but gave 4-5x SDPA's error at realistic logit sizes."""
    n, h, d = q.shape
    h_kv, length, _ = k.shape
    g = h // h_kv
    past = length - n
    k, v = k.float(), v.contiguous()
    rows = (q.view(n, h_kv, g, d).transpose(0, 1).float() * scale).reshape(h_kv, n * g, d)
    hidden = _keys_after_query(g)
    out_rows = out.view(n, h_kv, g, d)
    for s in range(0, n, PIECE):
        e = min(n, s + PIECE)
        m, seen = e - s, past + e
        scores = soft_cap(torch.matmul(rows[:, s * g:e * g], k[:, :seen].transpose(-1, -2)), softcap)  # [Hkv, m * g, seen]
        scores[..., past + s:].masked_fill_(hidden[:m * g, :m], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out_rows[s:e] = torch.matmul(probs, v[:, :seen]).view(h_kv, m, g, d).transpose(0, 1)
    return out


def capped_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                           softcap: float) -> torch.Tensor:
    """One prefill chunk's attention with soft-capped scores, which SDPA cannot apply: q [H, n, D],
    k/v [Hkv, L, D], mask [n, L] (True = attend) or None for plain causal over the last n keys.
    Scores and softmax in float32, as SDPA's; returns [H, n, D] in q's dtype."""
    h, n, d = q.shape
    h_kv, length, _ = k.shape
    qg = q.reshape(h_kv, h // h_kv, n, d).float()
    scores = soft_cap(torch.matmul(qg, k.float().transpose(-1, -2).unsqueeze(1)) * scale, softcap)  # [Hkv, G, n, L]
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool).tril_(length - n)
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v.unsqueeze(1)).reshape(h, n, d).to(q.dtype)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None,
                     softcap: float = 0.0) -> torch.Tensor:
    """Write this step's K/V [T, Hkv, D] into their slots, then paged_attention."""
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale, softcap)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None,
                    softcap: float = 0.0) -> torch.Tensor:
    """q: [T, H, D]; k/v: this step's [T, Hkv, D], already written to the [Hkv, slots, D] caches.
    softcap > 0: scores soft-capped before the softmax (Gemma 2). Returns [T, H, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    d = meta.decode
    if d is not None:
        out[d.rows] = decode_attention(q[d.rows], k_cache, v_cache, d, meta.block_size, scale, softcap)
    for p in meta.prefills:
        if p.block_ids is None:
            kp, vp = k[p.start:p.end].transpose(0, 1), v[p.start:p.end].transpose(0, 1)
        else:
            kp = _gather_blocks(k_cache, p.block_ids, meta.block_size)[:, :p.num_kv]
            vp = _gather_blocks(v_cache, p.block_ids, meta.block_size)[:, :p.num_kv]
        if p.in_pieces:
            causal_pieces(q[p.start:p.end], kp, vp, scale, out[p.start:p.end], softcap)
            continue
        qp = q[p.start:p.end].transpose(0, 1)                                     # [H, q, D]
        if softcap > 0:
            out[p.start:p.end] = capped_chunk_attention(qp, kp, vp, p.mask, scale, softcap).transpose(0, 1)
            continue
        # 4-D inputs: with 3-D ones and enable_gqa, CPU SDPA takes its math path (2.1x slower at
        # 512 tokens) instead of the flash kernel.
        op = F.scaled_dot_product_attention(qp[None], kp[None], vp[None], attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=scale, enable_gqa=True)
        out[p.start:p.end] = op[0].transpose(0, 1)
    return out


# --- prefill and mixed steps under torch.compile -------------------------------------------------
# A step's AttentionMetadata (python lists, per-chunk masks) cannot be a graph input without the
# graph specialising on its structure. The compiled step instead carries a one-element tensor naming
# the metadata registered here for the duration of the call, and attention runs as an opaque custom
# op around the eager paged_attention: the graph fuses everything between the matmuls and the
# attention, which is where a prefill step spends what is not matmul or attention.
_STEP_METAS: dict[int, AttentionMetadata] = {}


@dataclass
class GraphStepMeta:
    """A prefill or mixed batch inside the compiled step: the key of its registered metadata."""
    key: torch.Tensor  # [1] int64


def register_step_meta(key: int, meta: AttentionMetadata) -> None:
    _STEP_METAS[key] = meta


def unregister_step_meta(key: int) -> None:
    _STEP_METAS.pop(key, None)


@torch.library.custom_op("tokenmill::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, key: torch.Tensor, scale: float, window: int,
                       softcap: float) -> torch.Tensor:
    """window: a sliding-window layer's window, 0 for full attention; softcap: 0 for none."""
    meta = _STEP_METAS[int(key)]
    return write_and_attend(q, k, v, k_cache, v_cache, meta.with_window(window) if window else meta, scale, softcap)


@paged_attention_op.register_fake
def _paged_attention_shape(q, k, v, k_cache, v_cache, key, scale, window, softcap):
    return torch.empty_like(q)
