"""The Llama family (Llama 2/3, SmolLM2, ...): pre-norm decoder, RoPE, grouped-query attention,
SwiGLU MLP, optionally tied embeddings."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.gguf.config import ModelConfig
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.attention import AttentionMetadata, GraphDecodeMeta, GraphStepMeta
from tokenmill.model.decoder import DecoderLM, Parts
from tokenmill.model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, interleaved_to_half_split


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, activation="silu")

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        q, k, v = self.attn.project_qkv(self.attn_norm(x), cos, sin)
        x = x + self.attn.attend(q, k, v, meta, k_cache, v_cache)
        return x + self.mlp(self.ffn_norm(x))


class LlamaModel(DecoderLM):
    BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, RMSNorm(cfg.dim, cfg.norm_eps))
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.context_length)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | GraphDecodeMeta | GraphStepMeta,
                kv: KVStorage | None = None, *, k_caches: list[torch.Tensor] | None = None,
                v_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Flat batch in, pre-norm hidden states out ([T, dim]); the caches (kv's, or the lists
        given) are written in place."""
        k_caches = kv.k if kv is not None else k_caches
        v_caches = kv.v if kv is not None else v_caches
        x = F.embedding(input_ids, self.embed)
        # A compiled graph cannot branch on data; its caller keeps positions within the context.
        cos, sin = self.rope.tables(positions, x.dtype, check=isinstance(meta, AttentionMetadata))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, meta, k_caches[i], v_caches[i])
        return x

    # --- loading -------------------------------------------------------------------------------
    def block_norms(self, block: LlamaBlock) -> dict[str, nn.Parameter]:
        return {"attn_norm": block.attn_norm.weight, "ffn_norm": block.ffn_norm.weight}

    def qkv_in_model_order(self, parts: Parts) -> Parts:
        """GGUF stores Llama's Q/K rows in rotary-interleaved order; the model rotates half-split."""
        (wq, iq), (wk, ik), v = parts
        cfg = self.config
        order_q = interleaved_to_half_split(torch.arange(wq.shape[0]).unsqueeze(1), cfg.n_heads).squeeze(1)
        order_k = interleaved_to_half_split(torch.arange(wk.shape[0]).unsqueeze(1), cfg.n_kv_heads).squeeze(1)
        return [(wq[order_q], None if iq is None else iq.permute_rows(order_q)),
                (wk[order_k], None if ik is None else ik.permute_rows(order_k)), v]
