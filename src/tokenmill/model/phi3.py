"""Phi-3 (mini and medium, their 4k-context models): Llama's decoder, stored fused. Its files keep
q, k and v in one tensor (attn_qkv) and the gate above the up projection in one (ffn_up): the very
layouts of tokenmill's fused projections, so each loads as a single part. Q/K rows are already in the
half-split (NEOX) rotary order, as Qwen's.

Two things of the file are not run, as neither llama.cpp nor transformers (loading the same GGUF)
runs them: the sliding window (phi3.attention.sliding_window, 2047 in Phi-3-mini-4k; llama.cpp
disables Phi's, its converters having written it for models that do not use it), so every layer
attends to the whole context; and LongRoPE, whose factor tensors (the 128k models, Phi-3.5, Phi-4-mini)
make ModelConfig refuse the file."""
from __future__ import annotations

from tokenmill.model.linear import GGUFWeight
from tokenmill.model.llama import LlamaModel


class Phi3Model(LlamaModel):
    BLOCK_TENSORS = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")

    def load_tensor(self, name: str, w: GGUFWeight, pending: dict[str, GGUFWeight]) -> None:
        if name.startswith("blk.") and name.endswith((".attn_qkv.weight", ".ffn_up.weight")):
            block = self.blocks[int(name.split(".")[1])]
            fused = block.attn.qkv_proj if ".attn_qkv." in name else block.mlp.gate_up_proj
            fused.load(w)
            return
        super().load_tensor(name, w, pending)
