"""How much GPU memory the KV cache gets: as vLLM's --gpu-memory-utilization, a share of the device's
memory for this model, less its weights and a workspace for a step's activations, the sampler and the
CUDA graphs; the rest holds KV blocks. Pure arithmetic on byte counts (measured by the caller, see
engine/device.py), so it is tested with made-up numbers."""
from __future__ import annotations

import torch

from tokenmill.gguf.config import ModelConfig

# Held back besides what a step's tensors need: cuBLAS workspaces, Triton's scratch, the caching
# allocator's rounding and fragmentation, the CUDA graphs' private pools.
FIXED_WORKSPACE = 512 * 2**20
ACTIVATION_BYTES = 2  # bf16


def workspace_bytes(mc: ModelConfig, max_tokens: int, max_rows: int) -> int:
    """Peak memory of one step beyond weights and KV cache: a micro-batch of max_tokens tokens (the
    residual stream, QKV, attention output, gate and up, each live at once at worst, doubled for the
    temporaries between them), and the sampler over max_rows rows of logits (the head's bf16 output,
    float32 logits, a float32 copy, and a sort's float32 values and int64 ids)."""
    qkv = (mc.n_heads + 2 * mc.n_kv_heads) * mc.head_dim
    per_token = (3 * mc.dim + qkv + mc.n_heads * mc.head_dim + 3 * mc.ffn_dim) * ACTIVATION_BYTES
    sampling = max_rows * mc.vocab_size * (ACTIVATION_BYTES + 4 + 4 + 4 + 8)
    return FIXED_WORKSPACE + 2 * max_tokens * per_token + sampling


def kv_budget_bytes(free_bytes: int, utilization: float, weights_bytes: int, workspace: int) -> int:
    """Bytes left for the KV cache: `utilization` of the memory that was free before the weights
    came, less the weights and the workspace (negative when they do not fit)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return int(free_bytes * utilization) - weights_bytes - workspace


def kv_tokens(budget_bytes: int, bytes_per_token: int, block_size: int, max_tokens: int | None = None) -> int:
    """Tokens of KV cache in whole blocks that fit the budget, at most max_tokens (None: no cap)."""
    tokens = max(0, budget_bytes) // bytes_per_token
    if max_tokens is not None:
        tokens = min(tokens, max_tokens)
    return tokens // block_size * block_size


def tensors_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied embeddings share
    one): on a GPU model, its weights' share of device memory."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
