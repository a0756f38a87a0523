"""Phi-3 (mini, medium), Phi-3.5-mini and Phi-4-mini: Llama's decoder, stored fused. Their files keep
q, k and v in one tensor (attn_qkv) and the gate above the up projection in one (ffn_up): the very
layouts of tokenmill's fused projections, so each loads as a single part. Q/K rows are already in the
half-split (NEOX) rotary order, as Qwen's.

The file's sliding window is not run (phi3.attention.sliding_window, 2047 in Phi-3-mini-4k), as
neither llama.cpp nor transformers loading the same GGUF runs it (llama.cpp disables Phi's, its
converters having written it for models that do not use it): every layer attends to the whole context.

LongRoPE (the 128k models, Phi-3.5, Phi-4-mini): per-frequency factors for contexts beyond
rope.scaling.original_context_length and for those within it, and cos/sin scaled by
rope.scaling.attn_factor. llama.cpp picks the factors once, by the context it runs with (its n_ctx);
transformers by each forward's length, which changes the keys' rotation mid-sequence. tokenmill picks
once, as llama.cpp: at load by the file's context (the long factors, in every such released model), then
by the engine's context (fit_context: the KV cache's size where that is smaller), so a server run with
a context within the original one (Ollama's default 4096 for Phi-3.5's 4096) takes the short factors as
llama.cpp there does. Phi-4-mini rotates the first 3/4 of each head (rope.dimension_count)."""
from __future__ import annotations

import torch

from tokenmill.gguf.config import LONGROPE, LONGROPE_TENSORS, ModelConfig
from tokenmill.gguf.reader import GGUFError
from tokenmill.model.linear import GGUFWeight
from tokenmill.model.llama import LlamaModel


class Phi3Model(LlamaModel):
    BLOCK_TENSORS = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self._longrope: dict[str, torch.Tensor] = {}  # the file's factors by tensor name: both kept (tiny)
        self._longrope_used: str | None = None

    def gguf_tensor_names(self) -> list[str]:
        return super().gguf_tensor_names() + (list(LONGROPE_TENSORS) if self.config.extra.get(LONGROPE) else [])

    def longrope_factors(self, context: int | None = None) -> str:
        """Which of the file's LongRoPE factor tensors a model run at `context` (default: the file's) takes
        (see the module's note)."""
        context = self.config.context_length if context is None else context
        long = context > self.config.extra["rope.scaling.original_context_length"]
        return LONGROPE_TENSORS[0] if long else LONGROPE_TENSORS[1]

    def load_tensor(self, name: str, w: GGUFWeight, pending: dict[str, GGUFWeight]) -> None:
        if name in LONGROPE_TENSORS:
            self._longrope[name] = w.dense
            if name == self.longrope_factors():
                self._use_longrope(name)
            return
        if name.startswith("blk.") and name.endswith((".attn_qkv.weight", ".ffn_up.weight")):
            block = self.blocks[int(name.split(".")[1])]
            fused = block.attn.qkv_proj if ".attn_qkv." in name else block.mlp.gate_up_proj
            fused.load(w)
            return
        super().load_tensor(name, w, pending)

    def fit_context(self, context: int) -> None:
        """The factors llama.cpp takes at this context: the short ones within the original context."""
        if self._longrope and self.longrope_factors(context) != self._longrope_used:
            self._use_longrope(self.longrope_factors(context))

    def _use_longrope(self, name: str) -> None:
        try:
            self.rope.set_longrope(self._longrope[name], self.config.extra.get("rope.scaling.attn_factor", 1.0))
        except ValueError as exc:
            raise GGUFError(str(exc)) from None
        self._longrope_used = name
