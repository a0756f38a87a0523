"""What an engine does differently when its model was loaded onto a GPU (LoadedModel.device), in the
one place it is decided: the KV cache sized from the device's free memory, and the runner that runs
steps there (engine/gpu_runner.py), with its decode steps captured as CUDA graphs when the engine
compiles (EngineConfig.compile). The scheduler, block manager, prefix cache and sampler are the
engine's own, the same on every device."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tokenmill.engine.config import ConfigError, EngineConfig
from tokenmill.engine.gpu_runner import DeviceModelRunner
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import LoadedModel
from tokenmill.model.gpu import memory
from tokenmill.model.gpu.buckets import DecodeBuffers
from tokenmill.model.gpu.graphs import DecodeGraphs

log = logging.getLogger("tokenmill.engine")

# Fewer KV tokens than this and a model cannot serve even a short conversation (engine/memory.py's
# MIN_KV_TOKENS, for the same reason).
MIN_KV_TOKENS = 256


def on_device(loaded: LoadedModel) -> bool:
    return loaded.device.type != "cpu"


def device_kv_tokens(cfg: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype, free_bytes: int) -> int:
    """KV tokens for a model whose weights are loaded, given the device memory free before they came
    (model/gpu/memory.py); capped by cfg.max_total_tokens. ConfigError when too few fit."""
    mc = loaded.config
    cfg = cfg.for_device(gpu=True)
    weights = memory.tensors_bytes(loaded.model)
    workspace = memory.workspace_bytes(mc, cfg.n_ubatch, min(cfg.parallel, cfg.n_ubatch))
    budget = memory.kv_budget_bytes(free_bytes, cfg.gpu_memory_utilization, weights, workspace)
    per_token = KVStorage.bytes_per_token(mc.n_layers, mc.n_kv_heads, mc.head_dim, kv_dtype)
    tokens = memory.kv_tokens(budget, per_token, cfg.block_size, cfg.max_total_tokens)
    if tokens < min(MIN_KV_TOKENS, cfg.num_blocks * cfg.block_size):
        raise ConfigError(
            f"not enough GPU memory for a KV cache: {cfg.gpu_memory_utilization:g} of {free_bytes / 2**30:.2f} GiB "
            f"free, less {weights / 2**30:.2f} GiB of weights and {workspace / 2**30:.2f} GiB of workspace, leaves "
            f"{max(budget, 0) / 2**20:.0f} MiB; {MIN_KV_TOKENS} tokens need {MIN_KV_TOKENS * per_token / 2**20:.0f} MiB "
            "(raise gpu_memory_utilization, or lower n_ubatch or parallel)")
    return tokens


def fit_device_kv_cache(cfg: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype) -> EngineConfig:
    """cfg with max_total_tokens set to what the device has room for (at most what cfg asked)."""
    device = loaded.device
    torch.cuda.empty_cache()  # the loader's temporaries: cached by torch, not free to the driver
    free_now, _ = torch.cuda.mem_get_info(device)
    free_before_weights = free_now + memory.tensors_bytes(loaded.model)
    tokens = device_kv_tokens(cfg, loaded, kv_dtype, free_before_weights)
    log.info("KV cache on %s: %d tokens (%.2f GiB free before the weights, utilization %g)", device, tokens,
             free_before_weights / 2**30, cfg.gpu_memory_utilization)
    return cfg if tokens == cfg.max_total_tokens else replace(cfg, max_total_tokens=tokens)


def build_device_runner(loaded: LoadedModel, kv: KVStorage, blocks: BlockManager, cfg: EngineConfig,
                        max_model_len: int) -> DeviceModelRunner:
    """The runner, with decode graphs captured for batches of up to min(parallel, n_ubatch) sequences
    when cfg.compile and the device is CUDA (capture failing leaves the steps eager, with a warning)."""
    cfg = cfg.for_device(gpu=True)
    graphs = None
    if cfg.compile and kv.device.type == "cuda":
        max_blocks = min(-(-max_model_len // cfg.block_size), cfg.num_blocks)
        buffers = DecodeBuffers(min(cfg.parallel, cfg.n_ubatch), max_blocks, cfg.block_size, kv.device)
        try:
            graphs = DecodeGraphs(loaded.model, kv, buffers)
            graphs.capture()
        except Exception as exc:  # noqa: BLE001 - serve eagerly rather than not at all
            log.warning("capturing CUDA graphs failed, decode steps run eagerly: %s: %s", type(exc).__name__, exc)
            graphs = None
    return DeviceModelRunner(loaded.model, kv, blocks, cfg.n_ubatch, graphs)
