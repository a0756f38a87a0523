"""Gemma 3 (text): a Llama-like decoder with four norms per block (before and after attention and
the MLP), RMSNorms over each q and k head, GeGLU, embeddings scaled by sqrt(dim), and two kinds of
attention layer: most attend within a sliding window of recent keys with a local rotary base, every
SLIDING_WINDOW_PATTERN-th attends to everything with the GGUF's rotary base.

The GGUF leaves out what llama.cpp and transformers hard-code for Gemma 3 (the layer pattern, the
local base, the attention scale); we hard-code the same values. All layers keep every key in the paged
cache; a local layer only masks the old ones (AttentionMetadata.with_window)."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.gguf.config import ModelConfig
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.decoder import DecoderLM, StepMeta
from tokenmill.model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, file_rotary, residual_step
from tokenmill.model.linear import GGUFWeight

SLIDING_WINDOW_PATTERN = 6  # layers 6, 12, ... (1-based) are global
LOCAL_ROPE_THETA = 10_000.0


def _norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps, weight_in_float32=True)


class Gemma3Block(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, scale: float | None, *, qk_norm: bool = True,
                 softcap: float = 0.0):
        """`qk_norm` and `softcap`: Gemma 3 norms each q and k head; Gemma 2 instead soft-caps the scores."""
        super().__init__()
        eps = cfg.norm_eps
        self.attn_norm, self.post_attn_norm = _norm(cfg.dim, eps), _norm(cfg.dim, eps)
        self.ffn_norm, self.post_ffn_norm = _norm(cfg.dim, eps), _norm(cfg.dim, eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale=scale,
                              qk_norm_eps=eps if qk_norm else None, window=window, softcap=softcap)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, activation="gelu_tanh")

    def forward(self, x, h, rope, meta, cache, next_norm: RMSNorm | None):
        """As LlamaBlock.forward: h = attn_norm(x) in, (x, next_norm(x)) out."""
        x, h = residual_step(x, self.attn(h, rope, meta, cache), self.post_attn_norm, self.ffn_norm)
        return residual_step(x, self.mlp(h), self.post_ffn_norm, next_norm)


class Gemma3Model(DecoderLM):
    BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                     "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    # What Gemma 2 (model/gemma2.py) sets otherwise: every how-many-th layer is global, the local
    # layers' rotary base (None: the file's, as the global layers'), the 27B's layer count (its
    # scores scale by dim / n_heads, its query_pre_attn_scalar: llama.cpp tells it apart the same way).
    WINDOW_PATTERN = SLIDING_WINDOW_PATTERN
    LOCAL_THETA: float | None = LOCAL_ROPE_THETA
    LAYERS_OF_27B = 62

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, _norm(cfg.dim, cfg.norm_eps))
        window = cfg.extra.get("attention.sliding_window")
        self.window = int(window) if window else None
        self.embed_scale = cfg.dim ** 0.5  # rounded to the model dtype once the weights are in
        self.rope = file_rotary(cfg)
        self.local_rope = (self.rope if self.LOCAL_THETA is None
                           else RotaryEmbedding(cfg.rope_dim, self.LOCAL_THETA, cfg.context_length))
        scale = (cfg.dim / cfg.n_heads) ** -0.5 if cfg.n_layers == self.LAYERS_OF_27B else None
        self.blocks = nn.ModuleList(self.make_block(cfg, None if self.is_global(i) else self.window, scale)
                                    for i in range(cfg.n_layers))

    def make_block(self, cfg: ModelConfig, window: int | None, scale: float | None) -> Gemma3Block:
        return Gemma3Block(cfg, window, scale)

    def is_global(self, layer: int) -> bool:
        return self.window is None or (layer + 1) % self.WINDOW_PATTERN == 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
                kv: KVStorage | None = None, *, k_caches: list[torch.Tensor] | None = None,
                v_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """As LlamaModel.forward: flat batch in, hidden states [T, dim] out, caches written in place."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        native_step = self.native_steps.get(self, meta, kv, x)
        if native_step is not None:
            return self.native_steps.run(native_step, x, positions, meta)
        caches = self.layer_caches(kv, k_caches, v_caches)
        options = self.rope_options(meta, x)
        ropes = {True: self.rope.at(positions, x.dtype, **options)}
        ropes[False] = ropes[True] if self.local_rope is self.rope else self.local_rope.at(positions, x.dtype, **options)
        h = self.blocks[0].attn_norm(x)
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            next_norm = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else None
            x, h = block(x, h, ropes[self.is_global(i)], meta, cache, next_norm)
        return x

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        return self.rope if self.is_global(layer) else self.local_rope

    # --- loading -------------------------------------------------------------------------------
    def load_tensor(self, name: str, w: GGUFWeight, pending: dict[str, GGUFWeight]) -> None:
        if name == "token_embd.weight":
            # transformers multiplies by sqrt(dim) rounded to the activations' dtype (25.25 in bf16).
            dtype = torch.float32 if w.dense is None else w.dense.dtype
            self.embed_scale = float(torch.tensor(self.config.dim ** 0.5, dtype=dtype))
        super().load_tensor(name, w, pending)

    # qkv_in_model_order stays as is: Gemma's GGUF keeps Q/K rows in the half-split rotary order.
    def block_norms(self, block: Gemma3Block) -> dict[str, nn.Parameter]:
        norms = {"attn_norm": block.attn_norm.weight, "post_attention_norm": block.post_attn_norm.weight,
                 "ffn_norm": block.ffn_norm.weight, "post_ffw_norm": block.post_ffn_norm.weight}
        if block.attn.q_norm is not None:
            norms.update(attn_q_norm=block.attn.q_norm.weight, attn_k_norm=block.attn.k_norm.weight)
        return norms
