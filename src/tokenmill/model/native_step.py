"""Every layer of a decoder step in one native call (csrc/decoder_step.cpp).

At one sequence the per-op path (each block's forward, kernel by kernel from Python) spent as long
calling its ~15 kernels per layer as running them; this hands the whole layer stack to C++ once per
step. It applies when every projection of the model runs through the quantized kernels (the gguf
weight mode: fp32 activations, GGUF blocks) and the step attends through the native paged kernel
(a PagedBatch). The blocks' forward stays the reference: the native step chains the same kernels in
the same order, so its hidden states are bitwise the per-op path's (tests/model/test_native_step.py).

TOKENMILL_NATIVE_STEP=0 turns it off (the per-op path runs), to measure what it saves."""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import TYPE_CHECKING, Iterator

import torch

from tokenmill.kernels import native, qmatmul as qk
from tokenmill.kernels.attention import CACHE_TYPES
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.paged_batch import PagedBatch

if TYPE_CHECKING:
    from tokenmill.kernels.head_argmax import GreedyHead
    from tokenmill.model.decoder import DecoderLM

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_enabled = os.environ.get("TOKENMILL_NATIVE_STEP", "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the body on the per-op path (for tests and benchmarks)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


def _parts(q) -> list[tuple] | None:
    """A projection's quantized parts (a Linear's `quantized`, the model's `head_quantized`) as (type,
    qs, sc, sup, rows, columns), or None if there are none or any part is not a native quantized weight."""
    if q is None or not all(isinstance(w, qk.QuantizedWeight) for w, _, _ in q.parts):
        return None
    return [(int(w.ggml_type), w.qs.data_ptr(), w.sc.data_ptr(), w.sup.data_ptr(), w.out_features, w.in_features)
            for w, _, _ in q.parts]


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class NativeStep:
    """One model's layer stack as a native DecoderStep of the active variant, bound to one KV storage."""

    def __init__(self, step, kv: KVStorage, rope_rows: int, has_greedy: bool = False):
        self.step = step
        self.kv = weakref.ref(kv)  # the step holds raw addresses into it: valid while it lives
        self.rope_rows = rope_rows
        self.has_greedy = has_greedy  # its variant has the bounded head kernel (greedy())

    @classmethod
    def build(cls, model: "DecoderLM", kv: KVStorage) -> "NativeStep | None":
        """The native step for this model and cache, or None when some part of the model cannot run
        natively (the per-op path then runs, as before)."""
        mod = native.module()
        cfg = model.config
        if mod is None or kv.dtype not in CACHE_TYPES or cfg.head_dim % 16:
            return None
        first = model.blocks[0]
        activation = _ACTIVATIONS.get(first.mlp.activation)
        if activation is None:
            return None
        scale = first.attn.scale if first.attn.scale is not None else cfg.head_dim ** -0.5
        step = mod.DecoderStep(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, first.attn_norm.eps,
                               activation, scale, CACHE_TYPES[kv.dtype], kv.num_blocks * kv.block_size)
        rope_rows = None
        for i, block in enumerate(model.blocks):
            attn, mlp = block.attn, block.mlp
            projections = [_parts(getattr(p, "quantized", None))
                           for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [block.attn_norm, block.ffn_norm, getattr(block, "post_attn_norm", None),
                     getattr(block, "post_ffn_norm", None), attn.q_norm, attn.k_norm]
            weights = [n.weight if n is not None else None for n in norms]
            bias = attn.qkv_proj.bias  # Qwen2's; the other projections have none
            if any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return None
            if None in projections or any(w is not None and w.dtype != torch.float32 for w in weights + [bias]):
                return None
            if any(n is not None and n.eps != first.attn_norm.eps for n in norms):
                return None
            if (attn.scale if attn.scale is not None else cfg.head_dim ** -0.5) != scale or mlp.activation != first.mlp.activation:
                return None
            rope = model.layer_rope(i)
            rope_rows = rope.cos.shape[0] if rope_rows is None else min(rope_rows, rope.cos.shape[0])
            step.add_layer(*(_addr(w) for w in weights), _addr(bias), *projections, rope.cos.data_ptr(),
                           rope.sin.data_ptr(), rope.cos.shape[0], rope.cos.stride(0), rope.cos.shape[1],
                           attn.window or 0, attn.softcap)
            layer = kv.layer(i)
            step.set_cache(i, layer.k.data_ptr(), layer.v.data_ptr(), _addr(layer.k_scale), _addr(layer.v_scale))
        residual_scales = {getattr(block, "residual_scale", 1.0) for block in model.blocks}
        if len(residual_scales) != 1:
            return None
        step.set_residual_scale(residual_scales.pop())
        head = _parts(model.head_quantized)
        norm = model.norm.weight
        if head is not None and norm.dtype == torch.float32 and norm.is_contiguous() and model.norm.eps == first.attn_norm.eps:
            step.set_head(norm.data_ptr(), head)
        return cls(step, kv, rope_rows, has_greedy=hasattr(mod, "head_argmax"))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """x: the step's embeddings, fp32 [T, dim]; returns the last layer's output (before the final
        norm), written over x."""
        if positions.numel() and int(positions.max()) >= self.rope_rows:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.rope_rows})")
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        tables = batch.block_tables
        self.step.forward(x.data_ptr(), x.shape[0], positions.data_ptr(), batch.slot_mapping.data_ptr(),
                          batch.cu_rows.data_ptr(), batch.start_pos.data_ptr(), batch.cu_rows.numel() - 1,
                          tables.data_ptr(), tables.shape[1], batch.block_size)
        return x

    @property
    def has_head(self) -> bool:
        return self.step.has_head

    def logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """DecoderLM.logits of the hidden states this step returned (fp32 [T, dim]): the final norm and
        the head of the rows `indices` (all when None) in one native call, bitwise the per-op path's."""
        if indices is None:
            n, rows = hidden.shape[0], 0
        else:
            indices = indices.to(torch.int64).contiguous()
            n, rows = indices.numel(), indices.data_ptr()
        out = torch.empty((n, self.step.vocab))
        self.step.logits(hidden.data_ptr(), hidden.shape[0], rows, n, out.data_ptr())
        return out


    def greedy(self, hidden: torch.Tensor, indices: torch.Tensor | None, head: "GreedyHead",
               exclude: tuple[int, ...] = ()) -> torch.Tensor:
        """DecoderLM.greedy_tokens of the hidden states this step returned: the final norm, the
        quantization and the bounded head kernel in one native call, bitwise head(final_hidden(...)).
        head: the model's GreedyHead (native), whose weight is this step's head; has_greedy must hold."""
        if indices is None:
            n, rows = hidden.shape[0], 0
        else:
            indices = indices.to(torch.int64).contiguous()
            n, rows = indices.numel(), indices.data_ptr()
        out = torch.empty(n, dtype=torch.int64)
        ids = torch.tensor(exclude, dtype=torch.int64) if exclude else None
        norms, coarse = head.kernel_inputs(n)
        self.step.greedy(hidden.data_ptr(), hidden.shape[0], rows, n, head.weight.qs.data_ptr(), norms, coarse,
                         ids.data_ptr() if ids is not None else 0, len(exclude), out.data_ptr())
        return out

    def set_profiling(self, on: bool) -> None:
        """Time each phase (matmuls, attention, norms, ...) of the following steps."""
        self.step.set_profiling(on)

    def take_profile(self) -> dict[str, float]:
        """Seconds per phase since the last call."""
        return dict(self.step.take_profile())


class NativeSteps:
    """A model's native step per (variant, cache dtype), built on first use and rebuilt when the model
    runs on another KV storage; None is remembered when the model cannot run natively."""

    def __init__(self):
        self._steps: dict[tuple[str, torch.dtype], NativeStep | None] = {}
        # The last step's output and the native step that made it, which can also take its logits.
        self._produced: tuple[weakref.ref, NativeStep] | None = None

    def get(self, model: "DecoderLM", meta, kv: KVStorage | None, x: torch.Tensor) -> NativeStep | None:
        if not _enabled or kv is None or not isinstance(meta, PagedBatch) or x.dtype != torch.float32:
            return None
        key = (native.variant(), kv.dtype)
        step = self._steps.get(key, False)
        if step is False or (step is not None and step.kv() is not kv):
            step = self._steps[key] = NativeStep.build(model, kv)
        return step

    def run(self, step: NativeStep, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """step(x, positions, batch), remembering what it returned: logits of exactly those hidden
        states can then take the step's head (head_for)."""
        out = step(x, positions, batch)
        self._produced = (weakref.ref(out), step) if step.has_head else None
        return out

    def head_for(self, hidden: torch.Tensor) -> NativeStep | None:
        """The native step that just returned `hidden`, when it also has the model's final norm and
        head; None for any other tensor (the per-op path then takes the logits)."""
        produced = self._produced
        if produced is None or produced[0]() is not hidden:
            return None
        return produced[1]

    def built(self) -> list[NativeStep]:
        """The native steps built so far (for profiling)."""
        return [s for s in self._steps.values() if s]
