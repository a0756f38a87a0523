"""Engine settings: one dataclass, validated once."""
from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    dtype: str = "bf16"
    block_size: int = 16
    max_total_tokens: int = 65536      # KV budget in tokens, across all sequences
    max_model_len: int | None = None   # per-sequence context (num_ctx); None = the model's own
    n_batch: int = 512                 # token budget of one step, shared by decodes and prefill chunks
    n_ubatch: int = 512                # most tokens one model call processes (micro-batch)
    parallel: int = 64                 # most sequences running at once
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        for name in ("block_size", "max_total_tokens", "n_batch", "n_ubatch", "parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_total_tokens < self.block_size:
            raise ConfigError(f"max_total_tokens ({self.max_total_tokens}) is below one block ({self.block_size})")

    @property
    def num_blocks(self) -> int:
        return self.max_total_tokens // self.block_size
