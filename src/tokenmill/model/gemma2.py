"""Gemma 2: Gemma 3's block (four norms, GeGLU, embeddings scaled by sqrt(dim)) without the q/k head
norms, and with two soft caps, cap * tanh(x / cap): on every attention score before the softmax
(gemma2.attn_logit_softcapping, 50 in the released models) and on the logits
(gemma2.final_logit_softcapping, 30). Local and global layers alternate, the first local, all with
the file's rotary base; the 27B (46 layers) scales its scores by dim / n_heads, as llama.cpp and
transformers hard-code.

The logit cap keeps the greedy token (tanh is increasing) but changes every probability, so the
logits a request sees, samples from or asks logprobs of are capped ones, on every path
(DecoderLM.logits). The score cap runs in every attention path: the native kernel (a template
parameter, so other models' kernels carry nothing of it), PyTorch's, and the GPU's Triton kernels."""
from __future__ import annotations

from tokenmill.gguf.config import ModelConfig
from tokenmill.model.gemma3 import Gemma3Block, Gemma3Model

# What the released models carry, for files that leave the keys out (transformers' defaults too).
DEFAULT_ATTN_SOFTCAP = 50.0
DEFAULT_FINAL_SOFTCAP = 30.0


class Gemma2Model(Gemma3Model):
    BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm",
                     "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    WINDOW_PATTERN = 2
    LOCAL_THETA = None
    LAYERS_OF_27B = 46

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.final_softcap = float(cfg.extra.get("final_logit_softcapping", DEFAULT_FINAL_SOFTCAP))

    def make_block(self, cfg: ModelConfig, window: int | None, scale: float | None) -> Gemma3Block:
        softcap = float(cfg.extra.get("attn_logit_softcapping", DEFAULT_ATTN_SOFTCAP))
        return Gemma3Block(cfg, window, scale, qk_norm=False, softcap=softcap)
