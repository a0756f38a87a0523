"""Hyperparameters read from GGUF metadata into one typed object per model."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.gguf.reader import GGUFError, GGUFFile

# Beyond any model tokenmill serves (Llama 3.1: 131,072 positions, head_dim 128; Gemma 3: 256), and
# small enough that the tables sized by them (the rotary table is positions x rope_dim floats) stay
# modest: a file that claims 2**32 positions must be refused, not allocated for.
MAX_CONTEXT = 1 << 20
MAX_HEAD_DIM = 1 << 12
# Positions x rotary dimension: the rotary tables (cos and sin, float32) are built whole when the
# model is, whatever the file's size, so a 10 KB file claiming a million positions at a head size of
# 4096 would cost 32 GB. 2**25 holds every model tokenmill serves (Gemma 3's 131,072 x 256; Llama
# 3.1's 131,072 x 128) at 256 MB a table.
MAX_ROTARY_TABLE = 1 << 25
# The native attention kernels work on heads of a multiple of 16 values (every real model's 64 to 256).
HEAD_DIM_MULTIPLE = 16

# The tensors each architecture's blocks hold beyond Llama's, with their sizes: "dim" (the embedding),
# "head" (a head's size), "q" or "kv" (the query's or a key's projection rows). A name without a suffix
# is a weight (".weight"); biases say ".bias". model/ has the same lists in its classes' BLOCK_TENSORS (a
# test keeps them in step); the shapes are checked here, before a model is built, so that a file whose
# tensors do not fit its numbers is refused rather than loaded into uninitialised or mis-sized weights.
_EXTRA_BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "gemma3": {"attn_q_norm": "head", "attn_k_norm": "head", "post_attention_norm": "dim", "post_ffw_norm": "dim"},
    "gemma2": {"post_attention_norm": "dim", "post_ffw_norm": "dim"},
    "qwen3": {"attn_q_norm": "head", "attn_k_norm": "head"},
    "qwen2": {"attn_q.bias": "q", "attn_k.bias": "kv", "attn_v.bias": "kv"},
}
# Architectures whose files store some of Llama's block tensors already fused: each fused tensor
# replaces its parts, its rows theirs stacked in this order (Phi-3: q, k, v in one; the gate's rows
# above the up projection's in "ffn_up").
_FUSED_BLOCK_TENSORS: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")},
}
# LongRoPE's per-frequency factors (Phi-3's 128k models, Phi-3.5, Phi-4-mini: phi3 files), for contexts
# beyond rope.scaling.original_context_length and within it. Noted in ModelConfig.extra as ROPE_FREQS
# is; in another architecture's file they are refused rather than run without.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LONGROPE = "rope_factors"
_LONGROPE_ARCHITECTURES = ("phi3",)
# Metadata numbers (under the architecture's prefix) checked where present: see ModelConfig.checked.
_NON_NEGATIVE_KEYS = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale",
                      "attn_logit_softcapping", "final_logit_softcapping")
_POSITIVE_KEYS = ("rope.scaling.factor", "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast",
                  "rope.scaling.yarn_beta_slow")
_ANY_NUMBER_KEYS = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier")


# Llama 3.1+ files carry their rotary scaling as a tensor: a divisor per rotary frequency (llama.cpp's
# rope_freqs, made from the model's rope_scaling "llama3" settings). ModelConfig.extra notes it (under
# this key, which no metadata key has) so that the model reads it and validation checks its shape.
ROPE_FREQS = "rope_freqs.weight"


def block_tensor_file_name(layer: int, name: str) -> str:
    """A block tensor's name in the file: "attn_q" -> "blk.3.attn_q.weight", "attn_q.bias" -> "blk.3.attn_q.bias"."""
    return f"blk.{layer}.{name}" + ("" if "." in name else ".weight")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    tied_embeddings: bool
    # Architecture-specific extras (e.g. Gemma 3's sliding window) live here, not as new fields.
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelConfig":
        return cls.from_metadata(g.architecture, g.metadata, {n: t.shape for n, t in g.tensors.items()},
                                 str(g.path))

    @classmethod
    def from_metadata(cls, arch: str, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                      source: str) -> "ModelConfig":
        """The config of a file with this metadata (an array may stand as any sequence of its length)
        and these tensors (name -> shape, PyTorch order), checked against them; `source` names the file
        in messages. gguf/validate.py calls it with what it read, without opening the file again."""
        p = arch + "."

        def require(key: str) -> Any:
            if key not in metadata:
                raise GGUFError(f"{source}: required metadata key {key!r} is missing")
            return metadata[key]

        n_heads = int(require(p + "attention.head_count"))
        dim = int(require(p + "embedding_length"))
        key_len = metadata.get(p + "attention.key_length")
        head_dim = int(key_len) if key_len else dim // max(n_heads, 1)  # a head count of 0: checked() says so
        n_kv = metadata.get(p + "attention.head_count_kv", n_heads)
        if isinstance(n_kv, Sequence):
            raise GGUFError(f"{source}: per-layer head_count_kv is not supported")
        vocab = metadata.get(p + "vocab_size")
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise GGUFError(f"{source}: cannot tell the vocabulary size")
            vocab = len(tokens)
        tied = "output.weight" not in shapes
        extra = {k[len(p):]: v for k, v in metadata.items() if k.startswith(p)}
        if ROPE_FREQS in shapes:
            extra[ROPE_FREQS] = True
        if arch in _LONGROPE_ARCHITECTURES and any(name in shapes for name in LONGROPE_TENSORS):
            extra[LONGROPE] = True
        return cls(
            architecture=arch,
            name=str(metadata.get("general.name", Path(source).stem)),
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(require(p + "block_count")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            ffn_dim=int(require(p + "feed_forward_length")),
            context_length=int(metadata.get(p + "context_length", 2048)),
            norm_eps=float(metadata.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(metadata.get(p + "rope.freq_base", 10000.0)),
            rope_dim=int(metadata.get(p + "rope.dimension_count", head_dim)),
            tied_embeddings=tied,
            extra=extra,
        ).checked(shapes)

    def checked(self, shapes: Mapping[str, tuple[int, ...]]) -> "ModelConfig":
        """This config, or GGUFError if its numbers cannot describe the file's tensors: a model is
        built from them before its weights are read, so a zero head count, a layer count in the
        billions or a rotary dimension of 2**31 would divide by zero or allocate without bound. The
        messages name the key, never the file."""
        p = self.architecture + "."

        def fail(key: str, value, why: str) -> GGUFError:
            shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."  # a string of megabytes
            return GGUFError(f"{p}{key} is {shown}: {why}")

        for key, value in (("embedding_length", self.dim), ("attention.head_count", self.n_heads),
                           ("attention.head_count_kv", self.n_kv_heads), ("feed_forward_length", self.ffn_dim),
                           ("vocab_size", self.vocab_size), ("block_count", self.n_layers)):
            if value < 1:
                raise fail(key, value, "must be at least 1")
        if self.n_layers > len(shapes):
            raise fail("block_count", self.n_layers, f"more layers than the file has tensors ({len(shapes)})")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise fail("attention.head_count_kv", self.n_kv_heads,
                       f"must divide attention.head_count ({self.n_heads})")
        if not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise GGUFError(f"a head's size ({p}attention.key_length, else embedding_length / head_count) is "
                            f"{self.head_dim}: must be 1 to {MAX_HEAD_DIM}")
        if not (2 <= self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise fail("rope.dimension_count", self.rope_dim, f"must be even and 2 to the head size ({self.head_dim})")
        if not 1 <= self.context_length <= MAX_CONTEXT:
            raise fail("context_length", self.context_length, f"must be 1 to {MAX_CONTEXT}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise fail("attention.layer_norm_rms_epsilon", self.norm_eps, "must be a positive number")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise fail("rope.freq_base", self.rope_theta, "must be a positive number")
        if self.head_dim % HEAD_DIM_MULTIPLE:
            raise GGUFError(f"a head's size ({p}attention.key_length, else embedding_length / head_count) is "
                            f"{self.head_dim}: tokenmill's attention kernels need a multiple of {HEAD_DIM_MULTIPLE}")
        if self.context_length * self.rope_dim > MAX_ROTARY_TABLE:
            raise GGUFError(f"{p}context_length ({self.context_length}) x {p}rope.dimension_count ({self.rope_dim}) "
                            f"is {self.context_length * self.rope_dim}: the rotary tables are limited to "
                            f"{MAX_ROTARY_TABLE} values (e.g. 131072 positions at 256)")
        window = self.extra.get("attention.sliding_window")  # Gemma's local layers (and Phi-3's, not run)
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
            raise fail("attention.sliding_window", window, "must be a whole number, 0 or more")
        # Numbers some architectures or scalings read, where the file has them: Granite's multipliers and
        # Gemma 2's caps (0: unset / off), the rotary scalings' factors, YaRN's variant knobs (any number:
        # model/layers.py refuses the ones it does not run).
        for keys, least, why in ((_NON_NEGATIVE_KEYS, 0.0, "must be a number, 0 or more"),
                                 (_POSITIVE_KEYS, None, "must be a positive number"),
                                 (_ANY_NUMBER_KEYS, -math.inf, "must be a number")):
            for key in keys:
                value = self.extra.get(key)
                if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                              and (value > 0 if least is None else value >= least)):
                    raise fail(key, value, why)
        longrope = [name for name in LONGROPE_TENSORS if name in shapes]
        if longrope and not self.extra.get(LONGROPE):
            raise GGUFError(f"the file's rotary scaling (LongRoPE: {longrope[0]}) is not supported for "
                            f"{self.architecture}")
        original = self.extra.get("rope.scaling.original_context_length")
        if original is None and (self.extra.get(LONGROPE) or self.extra.get("rope.scaling.type") == "yarn"):
            raise fail("rope.scaling.original_context_length", original, "LongRoPE and YaRN need it")
        if original is not None and not (isinstance(original, int) and not isinstance(original, bool) and original > 0):
            raise fail("rope.scaling.original_context_length", original, "must be a whole number above 0")
        embd = shapes.get("token_embd.weight")
        if embd is not None and embd[-1] != self.dim:
            raise fail("embedding_length", self.dim, f"token_embd.weight has rows of {embd[-1]}")
        self._check_tensors(shapes)
        return self

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, with the shape (rows first) its hyperparameters give it."""
        dim, head, ffn = self.dim, self.head_dim, self.ffn_dim
        q_rows, kv_rows = self.n_heads * head, self.n_kv_heads * head
        block = {"attn_norm": (dim,), "attn_q": (q_rows, dim), "attn_k": (kv_rows, dim), "attn_v": (kv_rows, dim),
                 "attn_output": (dim, q_rows), "ffn_norm": (dim,), "ffn_gate": (ffn, dim), "ffn_up": (ffn, dim),
                 "ffn_down": (dim, ffn)}
        sizes = {"dim": dim, "head": head, "q": q_rows, "kv": kv_rows}
        for name, size in _EXTRA_BLOCK_TENSORS.get(self.architecture, {}).items():
            block[name] = (sizes[size],)
        for fused, parts in _FUSED_BLOCK_TENSORS.get(self.architecture, {}).items():
            part_shapes = [block.pop(part) for part in parts]
            block[fused] = (sum(shape[0] for shape in part_shapes), part_shapes[0][1])
        shapes = {"token_embd.weight": (self.vocab_size, dim), "output_norm.weight": (dim,)}
        if self.extra.get(ROPE_FREQS):
            shapes[ROPE_FREQS] = (self.rope_dim // 2,)
        if self.extra.get(LONGROPE):
            shapes.update((name, (self.rope_dim // 2,)) for name in LONGROPE_TENSORS)
        if not self.tied_embeddings:
            shapes["output.weight"] = (self.vocab_size, dim)
        for i in range(self.n_layers):
            shapes.update({block_tensor_file_name(i, name): shape for name, shape in block.items()})
        return shapes

    def _check_tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor the model reads is in the file with the shape the hyperparameters give it:
        the model is built from the numbers, so a vocab_size above the embedding's rows would leave
        rows of uninitialised memory as weights, and a feed_forward_length of 2**31 would be
        allocated for before any tensor was read."""
        expected = self.tensor_shapes()
        missing = [name for name in expected if name not in shapes]
        if missing:
            raise GGUFError(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, shape in expected.items():
            if tuple(shapes[name]) != shape:
                raise GGUFError(f"tensor {name} has shape {list(shapes[name])}, but the hyperparameters "
                                f"({self.architecture}.*) make it {list(shape)}")
