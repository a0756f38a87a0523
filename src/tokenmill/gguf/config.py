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
            return GGUFError(f"{p}{key} is {value}: {why}")

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
        embd = shapes.get("token_embd.weight")
        if embd is not None and embd[-1] != self.dim:
            raise fail("embedding_length", self.dim, f"token_embd.weight has rows of {embd[-1]}")
        return self
