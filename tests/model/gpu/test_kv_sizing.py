"""The GPU KV cache's share of device memory (model/gpu/memory.py, engine/device.py), on made-up byte
counts: no GPU needed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.engine.config import ConfigError, EngineConfig
from tokenmill.engine.device import device_kv_tokens
from tokenmill.gguf.config import ModelConfig
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.gpu import memory

GiB = 2**30
# SmolLM2-135M's shapes.
SMOLLM2 = ModelConfig("llama", "smollm2", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=1536, context_length=8192, norm_eps=1e-5, rope_theta=1e5, rope_dim=64,
                      tied_embeddings=True)


def test_budget_is_the_share_of_free_memory_less_weights_and_workspace():
    assert memory.kv_budget_bytes(80 * GiB, 0.9, 1 * GiB, 2 * GiB) == int(72 * GiB) - 3 * GiB
    assert memory.kv_budget_bytes(80 * GiB, 1.0, 0, 0) == 80 * GiB
    assert memory.kv_budget_bytes(4 * GiB, 0.5, 3 * GiB, 0) < 0  # weights alone do not fit the share
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="utilization"):
            memory.kv_budget_bytes(GiB, bad, 0, 0)


def test_tokens_come_in_whole_blocks_within_the_budget_and_the_cap():
    per_token = KVStorage.bytes_per_token(30, 3, 64, torch.bfloat16)
    assert per_token == 2 * 30 * 3 * 64 * 2  # K and V, every layer, bf16
    budget = 10 * GiB
    tokens = memory.kv_tokens(budget, per_token, 64)
    assert tokens % 64 == 0 and tokens * per_token <= budget < (tokens + 64) * per_token
    assert memory.kv_tokens(budget, per_token, 64, max_tokens=65536) == 65536
    assert memory.kv_tokens(budget, per_token, 64, max_tokens=1000) == 960  # rounded down to blocks
    assert memory.kv_tokens(-5, per_token, 64) == 0
    assert memory.kv_tokens(per_token * 63, per_token, 64) == 0  # less than a block


def test_workspace_grows_with_the_micro_batch_and_the_sampled_rows():
    base = memory.workspace_bytes(SMOLLM2, 512, 64)
    assert base > memory.FIXED_WORKSPACE
    assert memory.workspace_bytes(SMOLLM2, 1024, 64) > base
    assert memory.workspace_bytes(SMOLLM2, 512, 256) - base == 192 * 49152 * 22
    # SmolLM2 at the defaults: well under a GiB, far below what an H100 holds.
    assert base < GiB


def fake_loaded(weights_bytes: int) -> SimpleNamespace:
    model = torch.nn.Module()
    model.register_buffer("weights", torch.empty(weights_bytes, dtype=torch.uint8))
    return SimpleNamespace(config=SMOLLM2, model=model)


def test_engine_kv_tokens_from_free_memory():
    cfg = EngineConfig(max_total_tokens=10**9, gpu_memory_utilization=0.9)
    loaded = fake_loaded(GiB // 4)
    per_token = KVStorage.bytes_per_token(30, 3, 64, torch.bfloat16)
    tokens = device_kv_tokens(cfg, loaded, torch.bfloat16, 80 * GiB)
    # n_ubatch and parallel left automatic: a GPU's (8192 tokens, 256 sequences).
    workspace = memory.workspace_bytes(SMOLLM2, 8192, 256)
    budget = int(80 * GiB * 0.9) - GiB // 4 - workspace
    assert tokens == budget // per_token // cfg.block_size * cfg.block_size
    # kv_size (max_total_tokens) caps it, as on the CPU.
    assert device_kv_tokens(EngineConfig(max_total_tokens=65536), loaded, torch.bfloat16, 80 * GiB) == 65536


def test_a_small_kv_size_is_kept_in_whole_blocks():
    cfg = EngineConfig(max_total_tokens=100, block_size=16)
    assert device_kv_tokens(cfg, fake_loaded(GiB // 4), torch.bfloat16, 80 * GiB) == 96


def test_engine_refuses_a_device_without_room():
    with pytest.raises(ConfigError, match="not enough GPU memory for a KV cache"):
        device_kv_tokens(EngineConfig(), fake_loaded(GiB), torch.bfloat16, 3 * GiB // 2)


def test_tensors_are_counted_once_when_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert memory.tensors_bytes(model) == 10 * 4 * 4
