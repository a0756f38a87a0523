"""The Llama family (Llama 2/3, SmolLM2, ...): pre-norm decoder, RoPE, grouped-query attention,
SwiGLU MLP, optionally tied embeddings."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.decoder import DecoderLM, Parts, StepMeta
from tokenmill.model.layers import (Attention, GatedMLP, RMSNorm, RotaryEmbedding, file_rotary,
                                   interleaved_to_half_split, residual_step)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, *, qk_norm: bool = False, scale: float | None = None,
                 residual_scale: float = 1.0):
        """`qk_norm`: RMSNorms over each q and k head (Qwen3's); `scale`: the scores' own scale, and
        `residual_scale`: what attention's and the MLP's outputs are multiplied by before they join the
        residual stream (Granite's attention and residual multipliers)."""
        super().__init__()
        self.residual_scale = residual_scale
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale=scale,
                              qk_norm_eps=cfg.norm_eps if qk_norm else None, qk_norm_weight_in_float32=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, activation="silu")

    def forward(self, x, h, rope, meta: StepMeta, cache, next_norm: RMSNorm | None):
        """One block on the residual stream x, given h = attn_norm(x) (the block before computed it with
        its residual add: one kernel on the GPU). Returns the new x and next_norm(x) (None without
        next_norm: the last block, whose final norm the head applies to the rows it needs)."""
        x, h = residual_step(x, self.scaled(self.attn(h, rope, meta, cache)), None, self.ffn_norm)
        return residual_step(x, self.scaled(self.mlp(h)), None, next_norm)

    def scaled(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.residual_scale == 1.0 else a * self.residual_scale


class LlamaModel(DecoderLM):
    BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")
    QK_NORM = False  # the blocks norm each q and k head (model/qwen.py's Qwen3)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, RMSNorm(cfg.dim, cfg.norm_eps))
        self.rope = file_rotary(cfg)
        self.blocks = nn.ModuleList(self.make_block(cfg) for _ in range(cfg.n_layers))
        self.embed_scale = 1.0  # what the embeddings are multiplied by (Granite's embedding multiplier)
        # The rotary tables the layers use, and which one each layer takes (one for Llama).
        self.rope_tables: list[RotaryEmbedding] = [self.rope]
        self.rope_of_layer: list[int] = [0] * cfg.n_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
                kv: KVStorage | None = None, *, k_caches: list[torch.Tensor] | None = None,
                v_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Flat batch in, pre-norm hidden states out ([T, dim]); the caches (kv's, or the lists
        given) are written in place."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        native_step = self.native_steps.get(self, meta, kv, x)
        if native_step is not None:
            return self.native_steps.run(native_step, x, positions, meta)
        caches = self.layer_caches(kv, k_caches, v_caches)
        options = self.rope_options(meta, x)
        ropes = [table.at(positions, x.dtype, **options) for table in self.rope_tables]
        h = self.blocks[0].attn_norm(x)
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            next_norm = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else None
            x, h = block(x, h, ropes[self.rope_of_layer[i]], meta, cache, next_norm)
        return x

    def make_block(self, cfg: ModelConfig) -> LlamaBlock:
        return LlamaBlock(cfg, qk_norm=self.QK_NORM)

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        return self.rope_tables[self.rope_of_layer[layer]]

    def divide_rope_frequencies(self, factors: torch.Tensor) -> None:
        try:
            self.rope.divide_frequencies(factors)
        except ValueError as exc:
            raise GGUFError(str(exc)) from None

    # --- loading -------------------------------------------------------------------------------
    def block_norms(self, block: LlamaBlock) -> dict[str, nn.Parameter]:
        return {"attn_norm": block.attn_norm.weight, "ffn_norm": block.ffn_norm.weight}

    def qkv_in_model_order(self, parts: Parts) -> Parts:
        """GGUF stores Llama's Q/K rows in rotary-interleaved order; the model rotates half-split."""
        wq, wk, v = parts
        cfg = self.config
        rows_q, rows_k = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        order_q = interleaved_to_half_split(torch.arange(rows_q).unsqueeze(1), cfg.n_heads).squeeze(1)
        order_k = interleaved_to_half_split(torch.arange(rows_k).unsqueeze(1), cfg.n_kv_heads).squeeze(1)
        return [wq.permute_rows(order_q), wk.permute_rows(order_k), v]


class SmolLM3Model(LlamaModel):
    """SmolLM3: Llama's decoder whose every fourth layer attends without positions (NoPE: no rotary
    embedding on q and k). llama.cpp hard-codes the interval (its files carry no key for it), as
    transformers' default no_rope_layer_interval does; those layers take tables that rotate by nothing."""

    NO_ROPE_INTERVAL = 4

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.no_rope = RotaryEmbedding.unrotated(cfg.rope_dim, cfg.context_length)
        self.rope_tables = [self.rope, self.no_rope]
        self.rope_of_layer = [int((i + 1) % self.NO_ROPE_INTERVAL == 0) for i in range(cfg.n_layers)]


class GraniteModel(LlamaModel):
    """IBM Granite (3.x dense): Llama's decoder with four multipliers from the file, which llama.cpp and
    transformers apply the same way: the embeddings times granite.embedding_scale, the scores scaled by
    granite.attention.scale (not 1/sqrt(head_dim)), each block's attention and MLP output times
    granite.residual_scale before it joins the residual stream, and the logits divided by
    granite.logit_scale. A key the file leaves out (or sets to 0, llama.cpp's "unset") is the plain
    Llama value."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_scale = granite_scale(cfg, "embedding_scale")
        self.logit_divisor = granite_scale(cfg, "logit_scale")

    def make_block(self, cfg: ModelConfig) -> LlamaBlock:
        scale = granite_scale(cfg, "attention.scale", None)
        return LlamaBlock(cfg, scale=scale, residual_scale=granite_scale(cfg, "residual_scale"))


def granite_scale(cfg: ModelConfig, key: str, unset: float | None = 1.0) -> float | None:
    value = float(cfg.extra.get(key) or 0.0)
    return value if value != 0.0 else unset
