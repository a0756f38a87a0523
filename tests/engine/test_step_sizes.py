"""Step sizes left automatic (n_batch, n_ubatch, parallel at 0) take the values of where the model
runs: 512 / 512 / 64 on a CPU, 8192 / 8192 / 256 on a GPU; values set explicitly are kept."""
from __future__ import annotations

import pytest

from engine_helpers import make_engine, random_ids
from tokenmill.engine import EngineConfig, SamplingParams
from tokenmill.engine.config import CPU_STEP_SIZES, GPU_STEP_SIZES, ConfigError
from tokenmill.engine.device import build_device_runner


def sizes(cfg: EngineConfig) -> tuple[int, int, int]:
    return cfg.n_batch, cfg.n_ubatch, cfg.parallel


def test_automatic_sizes_by_device_and_explicit_ones_kept():
    assert sizes(EngineConfig()) == (0, 0, 0)
    assert sizes(EngineConfig().for_device(gpu=False)) == (512, 512, 64) == sizes(CPU_STEP_SIZES)
    assert sizes(EngineConfig().for_device(gpu=True)) == (8192, 8192, 256) == sizes(GPU_STEP_SIZES)
    mixed = EngineConfig(n_batch=1024, parallel=8)
    assert sizes(mixed.for_device(gpu=True)) == (1024, 8192, 8)
    assert sizes(mixed.for_device(gpu=False)) == (1024, 512, 8)
    resolved = mixed.for_device(gpu=False)
    assert resolved.for_device(gpu=True) == resolved  # resolving twice changes nothing


@pytest.mark.parametrize("name", ["n_batch", "n_ubatch", "parallel"])
def test_negative_sizes_are_refused(name):
    with pytest.raises(ConfigError, match=f"{name} must be 0 \\(automatic\\) or more, got -1"):
        EngineConfig(**{name: -1}).validate()


def test_a_cpu_engine_runs_with_the_cpu_sizes(loaded):
    engine = make_engine(loaded, max_total_tokens=16384)
    assert sizes(engine.cfg) == (512, 512, 64)
    assert engine.runner.n_ubatch == 512
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(70):
        engine.add_request(random_ids(4, seed=i), params)
    engine.step()
    # 64 admitted (the automatic parallel), the rest wait: nothing ran beyond the CPU's limit.
    assert (engine.num_running(), engine.num_waiting()) == (64, 6)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used_blocks == 0


def test_the_device_runner_takes_the_gpu_sizes(loaded):
    """On CPU tensors (no graphs): the runner a GPU model gets micro-batches of 8192 tokens when the
    config leaves n_ubatch automatic, and keeps an explicit one."""
    engine = make_engine(loaded)
    runner = build_device_runner(loaded, engine.kv, engine.blocks, EngineConfig(), engine.max_model_len)
    assert runner.n_ubatch == 8192
    runner = build_device_runner(loaded, engine.kv, engine.blocks, EngineConfig(n_ubatch=300), engine.max_model_len)
    assert runner.n_ubatch == 300
