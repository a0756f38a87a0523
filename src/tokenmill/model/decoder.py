"""What every architecture's model shares: tied or separate embeddings and output head, the final
norm, logits for the sampled rows only, oneDNN packing, and the loading of GGUF tensors into fused
projections. An architecture adds its blocks, its forward, the names of its blocks' tensors and norms,
and the row order its rotary embedding wants for Q and K."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.gguf.config import ROPE_FREQS, ModelConfig, block_tensor_file_name
from tokenmill.gguf.reader import GGUFError
from tokenmill.kernels import gpu as gpu_ops
from tokenmill.kernels import native as native_kernels
from tokenmill.kernels.argmax import argmax_rows, excluding
from tokenmill.kernels.head_argmax import GreedyHead, coarse_copy_bytes
from tokenmill.kernels.qmatmul import QuantizedWeight
from tokenmill.kvcache.storage import KVStorage, LayerKV
from tokenmill.model.attention import AttentionMetadata, GraphDecodeMeta, GraphStepMeta, soft_cap
from tokenmill.model.gpu.batch import DeviceBatch
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, _param
from tokenmill.model.linear import GGUFWeight, Linear, PackedWeight, dense_linear, pack_bf16
from tokenmill.model.native_step import NativeSteps
from tokenmill.model.paged_batch import PagedBatch
from tokenmill.model.quantized import EmbeddingRows, QuantizedParts

Parts = list[GGUFWeight]
# What a step's attention reads: eager PyTorch metadata, the compiled graphs' tensors, or the native
# kernel's paged batch.
StepMeta = AttentionMetadata | GraphDecodeMeta | GraphStepMeta | PagedBatch
# When greedy_tokens takes the bounded head kernel (kernels/head_argmax.py, VNNI) rather than the full
# logits' argmax: below AMX_HEAD_ROWS rows, where the full head is on VNNI too (csrc/qmatmul_amx.h's
# kAmxWideRows), on a CPU without AMX, and once the logits would take LOGITS_OUT_OF_CACHE floats or more
# (writing and reading them back dominates). On the 2-core Sapphire Rapids box (2 threads, real hidden
# states) SmolLM2's head at 1 / 3 / 9 / 17 / 32 rows took 1.00 / 1.20 / 1.22 / 1.11 / 1.27x less time
# bounded, at 48 / 64 / 96 / 128 rows (AMX) 0.89 / 0.83 / 0.78 / 0.72x, at 192 (36 MB of logits) 1.52x;
# Gemma 3's (262,144 columns) 1.18-1.26x at 1-17 rows and 1.55-1.96x at 32-256.
AMX_HEAD_ROWS = 48
LOGITS_OUT_OF_CACHE = 8 << 20


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: RMSNorm):
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.dim)
        self.norm = norm
        self.lm_head = self.embed if cfg.tied_embeddings else _param(cfg.vocab_size, cfg.dim)
        self.lm_head_packed: PackedWeight | None = None
        # The gguf weight mode: embeddings read from the file's rows, the head from its blocks.
        self.embed_rows: EmbeddingRows | None = None
        self.head_quantized: QuantizedParts | None = None
        self.native_steps = NativeSteps()  # the whole layer stack in one native call, when it can run so
        self._greedy: tuple[QuantizedWeight, GreedyHead | None] | None = None  # greedy_tokens' head
        self.final_softcap = 0.0  # > 0: logits soft-capped, cap * tanh(logit / cap) (Gemma 2)
        self.logit_divisor = 1.0  # the logits divided by it (Granite's logit scale)

    def fit_context(self, context: int) -> None:
        """The context the model will run with (the engine's: at most the file's, less where the KV cache is
        smaller), told before its first step. An architecture whose rotary tables depend on it picks them
        here (Phi-3's LongRoPE factors, as llama.cpp picks them by its n_ctx); the rest need nothing."""

    def pack_weights(self) -> None:
        """After loading: give every dense bf16 weight its oneDNN-packed form (see model/linear.py)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack_dense()
        if self.head_quantized is None:
            self.lm_head_packed = pack_bf16(self.lm_head.data, self)

    def move_blocks(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The gguf weight mode: every projection's and the head's blocks to copies that place makes
        (kernels/huge_pages.py), before anything (the native step) takes their addresses."""
        for q in [m.quantized for m in self.modules() if isinstance(m, Linear)] + [self.head_quantized]:
            if q is not None:
                q.move_blocks(place)

    def all_weights_in_blocks(self) -> bool:
        """Every projection and the output head kept their GGUF blocks (the gguf weight mode, with no
        type the quantized kernels lack): a step's heavy math is then all in the quantized kernels."""
        parts = [m.quantized for m in self.modules() if isinstance(m, Linear)]
        return self.head_quantized is not None and all(q is not None and q.is_blocks for q in parts)

    def layer_caches(self, kv: KVStorage | None, k_caches: list[torch.Tensor] | None,
                     v_caches: list[torch.Tensor] | None) -> list[LayerKV]:
        if kv is not None:
            return [kv.layer(i) for i in range(self.config.n_layers)]
        return [LayerKV(k, v) for k, v in zip(k_caches, v_caches)]

    @staticmethod
    def rope_options(meta: StepMeta | DeviceBatch, x: torch.Tensor) -> dict:
        # A compiled graph cannot branch on data; its caller keeps positions within the context (the
        # GPU runner checks them on the host). The native step and the GPU kernels rotate in place.
        fused = isinstance(meta, PagedBatch) or (isinstance(meta, DeviceBatch) and gpu_ops.use_triton(x))
        return {"check": isinstance(meta, (AttentionMetadata, PagedBatch)), "fused": fused}

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        """The rotary embedding layer `layer` uses."""
        raise NotImplementedError

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_rows is not None:
            return self.embed_rows(ids)
        return F.embedding(ids, self.embed)

    def final_hidden(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(hidden if indices is None else hidden[indices])

    def logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits only for the rows that sample, as llama.cpp's output flags do, in the model's
        dtype (the head has already rounded them to it); the sampler widens them to float32."""
        native = self.native_steps.head_for(hidden)
        if native is not None:  # the layer stack ran natively: its norm and head in the same core, one call
            logits = native.logits(hidden, indices)
        else:
            h = self.final_hidden(hidden, indices)
            if self.head_quantized is not None:
                logits = self.head_quantized.matmul(h)
            else:
                logits = dense_linear(h, self.lm_head, self.lm_head_packed)
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.final_softcap > 0:
            return soft_cap(logits.float(), self.final_softcap).to(logits.dtype)
        return logits

    def transforms_logits(self) -> bool:
        """The head's output is not the logits as they stand (a cap or a divisor): greedy_tokens then
        argmaxes the logits themselves (a transformed logit can tie where the raw ones do not), not
        the bounded head kernel."""
        return self.final_softcap > 0 or self.logit_divisor != 1.0

    def greedy_tokens(self, hidden: torch.Tensor, indices: torch.Tensor | None = None,
                      exclude: tuple[int, ...] = ()) -> torch.Tensor:
        """int64 [rows]: each row's greedy token, the first index of its largest logit (torch.max's),
        bitwise logits(hidden, indices)'s with the columns `exclude` (suppressed ids) at -inf. With a
        Q8_0 head the bounded kernel (kernels/head_argmax.py) skips most of the head's work where that
        pays (AMX_HEAD_ROWS); otherwise the logits' argmax."""
        head = self._greedy_head()
        rows = hidden.shape[0] if indices is None else indices.numel()
        if head is None or not (rows < AMX_HEAD_ROWS or not native_kernels.amx()
                                or rows * self.head_quantized.out_features >= LOGITS_OUT_OF_CACHE):
            return argmax_rows(excluding(self.logits(hidden, indices).float(), exclude))
        native = self.native_steps.head_for(hidden)
        if native is not None and native.has_greedy:  # the layers ran natively: the norm and this head in one call
            return native.greedy(hidden, indices, head, exclude)
        return head(self.final_hidden(hidden, indices).float(), exclude)

    def _greedy_head(self) -> GreedyHead | None:
        """The head's GreedyHead when its bounded kernel runs here (one Q8_0 part on the CPU), made once
        per head weight (move_blocks replaces it), with the 6-bit copy where greedy_head_bytes says."""
        w = self._head_weight()
        if w is None or self.transforms_logits():
            return None
        if self._greedy is None or self._greedy[0] is not w:
            head = GreedyHead(w, coarse=self.greedy_head_bytes() > 0)
            self._greedy = (w, head if head.native else None)
        return self._greedy[1]

    def _head_weight(self) -> QuantizedWeight | None:
        q = self.head_quantized
        if q is None or len(q.parts) != 1 or not isinstance(q.parts[0][0], QuantizedWeight):
            return None
        return q.parts[0][0]

    def greedy_head_bytes(self) -> int:
        """What the greedy head keeps besides the weights: a 6-bit copy of a head that is most of the
        weights' bytes (kernels/head_argmax.py), counted from the load on, made at the first greedy step."""
        w = self._head_weight()
        if w is None or w.qs.device.type != "cpu" or self.transforms_logits():
            return 0
        layers = sum(m.quantized.nbytes for m in self.modules() if isinstance(m, Linear) and m.quantized is not None)
        return coarse_copy_bytes(w.ggml_type, w.out_features, w.in_features, w.nbytes, w.nbytes + layers)

    # Each block's GGUF tensor names without "blk.N.": "attn_q" for a weight (".weight" implied), "attn_q.bias".
    BLOCK_TENSORS: tuple[str, ...] = ()

    def gguf_tensor_names(self) -> list[str]:
        names = ["token_embd.weight", "output_norm.weight"]
        if not self.config.tied_embeddings:
            names.append("output.weight")
        if self.config.extra.get(ROPE_FREQS):
            names.append(ROPE_FREQS)
        for i in range(self.config.n_layers):
            names += [block_tensor_file_name(i, n) for n in self.BLOCK_TENSORS]
        return names

    def load_tensor(self, name: str, w: GGUFWeight, pending: dict[str, GGUFWeight]) -> None:
        """Place one GGUF tensor (norms always come dense); parts of fused weights wait in `pending`
        for their siblings."""
        if name == "token_embd.weight":
            if w.raw is not None:
                self.embed_rows = EmbeddingRows(w.raw)
                self.embed.data = torch.empty(0)
                if self.config.tied_embeddings:
                    self.head_quantized = QuantizedParts([w.raw])
            else:
                self.embed.data = w.dense
            if self.config.tied_embeddings:
                self.lm_head = self.embed
            return
        if name == "output.weight":
            if w.raw is not None:
                self.head_quantized = QuantizedParts([w.raw])
                self.lm_head.data = torch.empty(0)
            else:
                self.lm_head.data = w.dense
            return
        tensor = w.dense
        if name == "output_norm.weight":
            self.norm.weight.data = tensor
            return
        if name == ROPE_FREQS:
            self.divide_rope_frequencies(tensor)
            return
        _, idx, part, kind = name.split(".")
        block = self.blocks[int(idx)]
        if kind == "bias":  # Qwen2's q, k, v: one bias for the fused projection, in its rows' order
            pending[name] = w
            biases = take_parts(pending, [f"blk.{idx}.attn_{p}.bias" for p in "qkv"])
            if biases:
                block.attn.qkv_proj.set_bias(torch.cat([b.dense for b in self.qkv_in_model_order(biases)]))
            return
        norms = self.block_norms(block)
        if part in norms:
            norms[part].data = tensor
            return
        linears = {"attn_output": block.attn.o_proj, "ffn_down": block.mlp.down_proj}
        if part in linears:
            linears[part].load(w)
            return
        pending[name] = w
        qkv = take_parts(pending, [f"blk.{idx}.attn_{p}.weight" for p in "qkv"])
        if qkv:
            block.attn.qkv_proj.load_parts(self.qkv_in_model_order(qkv))
        gate_up = take_parts(pending, [f"blk.{idx}.ffn_gate.weight", f"blk.{idx}.ffn_up.weight"])
        if gate_up:
            block.mlp.gate_up_proj.load_parts(gate_up)

    def block_norms(self, block: nn.Module) -> dict[str, nn.Parameter]:
        """A block's norm weights by their GGUF names."""
        raise NotImplementedError

    def divide_rope_frequencies(self, factors: torch.Tensor) -> None:
        """The file's rope_freqs (Llama 3.1+'s rotary scaling): each rotary frequency divided by its factor."""
        raise GGUFError(f"{ROPE_FREQS} is not supported for {self.config.architecture}")

    def qkv_in_model_order(self, parts: Parts) -> Parts:
        """The Q, K, V parts with their rows in the order the model's rotary embedding expects."""
        return parts


def take_parts(pending: dict[str, GGUFWeight], names: list[str]) -> Parts | None:
    """The parts of a fused weight, removed from `pending`, once all of them have arrived."""
    if not all(n in pending for n in names):
        return None
    return [pending.pop(n) for n in names]
