"""Hyperparameters read from GGUF metadata into one typed object per model."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.gguf.reader import GGUFError, GGUFFile


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
        arch = g.architecture
        p = arch + "."
        n_heads = int(g.require(p + "attention.head_count"))
        dim = int(g.require(p + "embedding_length"))
        key_len = g.get(p + "attention.key_length")
        head_dim = int(key_len) if key_len else dim // n_heads
        n_kv = g.get(p + "attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):
            raise GGUFError(f"{g.path}: per-layer head_count_kv is not supported")
        vocab = g.get(p + "vocab_size")
        if vocab is None:
            tokens = g.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise GGUFError(f"{g.path}: cannot tell the vocabulary size")
            vocab = len(tokens)
        tied = "output.weight" not in g.tensors
        extra = {k[len(p):]: v for k, v in g.metadata.items() if k.startswith(p)}
        return cls(
            architecture=arch,
            name=str(g.get("general.name", g.path.stem)),
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(g.require(p + "block_count")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            ffn_dim=int(g.require(p + "feed_forward_length")),
            context_length=int(g.get(p + "context_length", 2048)),
            norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g.get(p + "rope.freq_base", 10000.0)),
            rope_dim=int(g.get(p + "rope.dimension_count", head_dim)),
            tied_embeddings=tied,
            extra=extra,
        )
