"""Qwen2 (Qwen2.5, DeepSeek-R1's Qwen distills) and Qwen3 (dense): Llama's decoder with two changes
each. Qwen2's q, k and v projections have biases; Qwen3's have none but norm each q and k head (an
RMSNorm over the head, before the rotary embedding, as Gemma 3 does). Both rotate in the half-split
(NEOX) layout, which their GGUF files keep, so Q/K rows need no reordering (Llama's files interleave).

Qwen3's head size may differ from dim / heads (attention.key_length: 128 in Qwen3-0.6B's 1024 / 16);
ModelConfig reads it, as for Gemma 3. Its head norms round before the weight multiplies, as Llama's
norm (transformers' Qwen3RMSNorm), except in the GPU's fused rotary kernel, which multiplies first as
for Gemma: the same in float32, within bf16 rounding there (tests/kernels/gpu/test_gpu_layer_model.py)."""
from __future__ import annotations

from torch import nn

from tokenmill.model.decoder import Parts
from tokenmill.model.llama import LlamaBlock, LlamaModel


class _NeoxLlama(LlamaModel):
    """A Llama whose file already holds Q/K rows in the half-split order (rope scaling as Llama's:
    linear, or YaRN, which Qwen's long-context settings use: layers.file_rotary)."""

    def qkv_in_model_order(self, parts: Parts) -> Parts:
        return parts


class Qwen2Model(_NeoxLlama):
    BLOCK_TENSORS = LlamaModel.BLOCK_TENSORS + ("attn_q.bias", "attn_k.bias", "attn_v.bias")


class Qwen3Model(_NeoxLlama):
    BLOCK_TENSORS = LlamaModel.BLOCK_TENSORS + ("attn_q_norm", "attn_k_norm")
    QK_NORM = True

    def block_norms(self, block: LlamaBlock) -> dict[str, nn.Parameter]:
        return {**super().block_norms(block), "attn_q_norm": block.attn.q_norm.weight,
                "attn_k_norm": block.attn.k_norm.weight}
