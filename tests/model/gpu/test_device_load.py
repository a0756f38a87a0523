"""Loading a model for a GPU (model/gpu/load.py, load_model(device=...)): each tensor's uploaded bytes
dequantized with torch ops give the CPU bf16 loader's bits, for every weight type; the device choice
and its errors. The whole load onto CUDA runs only where there is a GPU."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.config import BY_NAME, load_config
from tokenmill.engine.config import DEVICES as ENGINE_DEVICES, ConfigError, EngineConfig
from tokenmill.gguf.reader import TensorInfo, open_gguf
from tokenmill.gguf.weights import dequantize
from tokenmill.model import ModelLoadError, load_model
from tokenmill.model.gpu.device import DEVICES, DeviceUnavailable, resolve_device
from tokenmill.model.gpu.load import check_device_mode, device_weight

Q = gguf.GGMLQuantizationType
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Rows of 256 values, so the K-quants (256-value blocks) fit every matrix.
SPEC = dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=256, n_layers=1)


@pytest.mark.parametrize("wtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_device_weights_are_the_cpu_loaders_bf16_bits(tmp_path, wtype):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=wtype, **SPEC))
    g = open_gguf(path)
    assert wtype in {t.ggml_type for t in g.tensors.values()}
    for info in g.tensors.values():
        ours = device_weight(info, torch.device("cpu")).dense
        expected = dequantize(info, torch.bfloat16)
        assert ours.dtype == torch.bfloat16 and ours.shape == expected.shape
        assert torch.equal(ours.view(torch.int16), expected.view(torch.int16)), info.name


@pytest.mark.parametrize("wtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_tensors_too(wtype):
    """gguf-py cannot write K-quants, so a tensor of random blocks stands in for one read from a file
    (its float16 scales set to finite values)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[wtype]
    rng = np.random.default_rng(int(wtype))
    rows, cols = 8, 2 * block_size
    data = rng.integers(0, 256, size=(rows * 2, type_size), dtype=np.uint8)
    for at in ([208] if wtype == Q.Q6_K else [0, 2]):  # d (and dmin)
        data[:, at:at + 2] = (rng.standard_normal(rows * 2) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    info = TensorInfo("blk.0.ffn_up.weight", (rows, cols), wtype, data.reshape(rows, 2 * type_size))
    ours = device_weight(info, torch.device("cpu")).dense
    assert torch.equal(ours.view(torch.int16), dequantize(info, torch.bfloat16).view(torch.int16))


def test_device_choice():
    assert DEVICES == ENGINE_DEVICES == BY_NAME["device"].choices
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        resolve_device("tpu")
    check_device_mode("auto")
    check_device_mode(torch.bfloat16)
    for mode in ("gguf", "fp32", torch.float32):
        with pytest.raises(ValueError, match="bf16"):
            check_device_mode(mode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_cuda_without_a_gpu_is_a_clear_load_error(tiny_gguf):
    with pytest.raises(ModelLoadError, match="device cuda asked for, but"):
        load_model(tiny_gguf, "auto", device="cuda")
    assert load_model(tiny_gguf, torch.float32, device="auto").device == torch.device("cpu")


def test_settings_reach_the_engine(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('device = "cpu"\ngpu_memory_utilization = 0.5\n')
    cfg = load_config(None, env={}, config_file=path).engine_config()
    assert (cfg.device, cfg.gpu_memory_utilization) == ("cpu", 0.5)
    cfg = load_config(None, env={"TOKENMILL_DEVICE": "cuda", "TOKENMILL_GPU_MEMORY_UTILIZATION": "0.8"})
    assert (cfg.device, cfg.gpu_memory_utilization) == ("cuda", 0.8)
    assert load_config(None, env={}).engine_config().device == "auto"  # the CLI's default
    assert EngineConfig().device == "cpu"  # the library's
    with pytest.raises(Exception, match="gpu_memory_utilization must be at most 1"):
        load_config(None, env={"TOKENMILL_GPU_MEMORY_UTILIZATION": "1.5"})
    with pytest.raises(Exception, match="device must be one of auto, cpu, cuda"):
        load_config(None, env={"TOKENMILL_DEVICE": "gpu"})
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0).validate()
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(device="metal").validate()
    # decode steps in a row (engine/decode_steps.py): 0 = automatic, from the flag, env and file alike
    assert load_config(None, env={}).engine_config().decode_steps == 0
    assert load_config(None, env={"TOKENMILL_DECODE_STEPS": "8"}).engine_config().decode_steps == 8
    with pytest.raises(Exception, match="decode_steps"):
        load_config(None, env={"TOKENMILL_DECODE_STEPS": "65"})
    with pytest.raises(ConfigError, match="decode_steps"):
        EngineConfig(decode_steps=-1).validate()


@CUDA
def test_load_onto_cuda(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=Q.Q5_0, **SPEC))
    on_gpu = load_model(path, "auto", device="cuda")
    on_cpu = load_model(path, torch.bfloat16, int4=False)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.bfloat16
    assert all(t.device.type == "cuda" for t in [*on_gpu.model.parameters(), *on_gpu.model.buffers()])
    gpu_params = dict(on_gpu.model.named_parameters())
    for name, p in on_cpu.model.named_parameters():
        assert torch.equal(gpu_params[name].cpu(), p), name
    with pytest.raises(ModelLoadError, match="not available on a GPU"):
        load_model(path, "gguf", device="cuda")
