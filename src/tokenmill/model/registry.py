"""general.architecture -> model class, and the one function that turns a GGUF path into a ready model."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tokenmill.gguf.config import LONGROPE_TENSORS, ROPE_FREQS, ModelConfig
from tokenmill.gguf.reader import GGUFError, GGUFFile, open_gguf
from tokenmill.gguf.weights import check_supported, dequantize
from tokenmill.kernels import huge_pages, native
from tokenmill.model.gpu.device import resolve_device
from tokenmill.model.gpu.load import check_device_mode, device_weight, finish_on_device
from tokenmill.model.linear import GGUFWeight, Int4Weight, onednn_bf16_available
from tokenmill.model.quantized import RawTensor, pack_all, packed_together
from tokenmill.model.gemma2 import Gemma2Model
from tokenmill.model.gemma3 import Gemma3Model
from tokenmill.model.llama import GraniteModel, LlamaModel, SmolLM3Model
from tokenmill.model.phi3 import Phi3Model
from tokenmill.model.qwen import Qwen2Model, Qwen3Model

ARCHITECTURES: dict[str, type] = {"llama": LlamaModel, "smollm3": SmolLM3Model, "gemma3": Gemma3Model,
                                  "qwen2": Qwen2Model, "qwen3": Qwen3Model, "phi3": Phi3Model,
                                  "gemma2": Gemma2Model, "granite": GraniteModel}

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
# Weight modes beyond a dense dtype: "gguf" keeps every weight in its GGUF blocks and runs them through
# the native quantized matmuls with float32 activations; "auto" is gguf where the compiled core runs,
# else bf16 where oneDNN has a bf16 path, else fp32.
MODES = ("auto", "gguf", *DTYPES)


class ModelLoadError(Exception):
    """The model cannot be loaded; the message names the problem."""


class ModelFileError(ModelLoadError):
    """The model cannot be loaded because of what its file holds (not the machine's doing): a server
    answers it as the request's fault, not its own."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    gguf: GGUFFile
    dtype: torch.dtype
    load_seconds: float
    weights: str = "dense"  # "gguf": the weights stayed in their GGUF blocks
    device: torch.device = torch.device("cpu")  # where the weights are and the model runs


def resolve_mode(dtype: str | torch.dtype) -> str:
    """'gguf', 'bf16' or 'fp32' for what the user asked (see MODES)."""
    if isinstance(dtype, torch.dtype):
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    if dtype == "auto":
        if native.module() is not None:
            return "gguf"
        return "bf16" if onednn_bf16_available() else "fp32"
    if dtype == "gguf":
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(MODES)})")
    return "bf16" if DTYPES[dtype] == torch.bfloat16 else "fp32"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The activations' dtype of a mode."""
    return torch.bfloat16 if resolve_mode(dtype) == "bf16" else torch.float32


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", *, progress: bool = False,
               int4: bool = True, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a GGUF model in a weight mode (MODES). With `int4` (and bf16), 4-bit GGUF weights are
    also kept int4-packed for few-row steps (see model/linear.py). On a device other than the CPU
    (cuda, or auto finding one) the weights are dense bf16, dequantized there (model/gpu/load.py)."""
    start = time.perf_counter()
    try:
        target = resolve_device(device)
        if target.type != "cpu":
            check_device_mode(dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    on_device = target.type != "cpu"
    mode = "bf16" if on_device else resolve_mode(dtype)
    dtype = resolve_dtype(mode)
    try:
        g = open_gguf(path)
        arch = g.architecture
        if arch not in ARCHITECTURES:
            raise ModelFileError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        check_supported(g)
        cfg = ModelConfig.from_gguf(g)
        with torch.device("cpu"):
            model = ARCHITECTURES[arch](cfg)
        pending: dict = {}
        names = model.gguf_tensor_names()
        missing = [n for n in names if n not in g.tensors]
        if missing:
            raise GGUFError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        # The gguf mode's weights are repacked for the kernels after the loop, in parallel (most of a
        # load's time), each straight into huge pages where the system gives them.
        with packed_together() as waiting:
            for name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False):
                info = g.tensors[name]
                if name in (ROPE_FREQS, *LONGROPE_TENSORS):  # rotary factors: exact, whatever the weights' dtype
                    weight = GGUFWeight(dense=dequantize(info, torch.float32))
                else:
                    weight = device_weight(info, target) if on_device else _weight(info, mode, dtype, int4)
                model.load_tensor(name, weight, pending)
        if pending:
            raise ModelFileError(f"{path}: tensors without their fused siblings: {sorted(pending)[:4]}")
        arena = huge_pages.HugePageArena() if waiting and huge_pages.wanted() else None
        pack_all(waiting, torch.get_num_threads(), arena.copy_of if arena is not None else None)
        model.rope.to(torch.float32)
        if on_device:
            finish_on_device(model, target)
        else:
            model.pack_weights()
            if arena is not None:
                huge_pages.return_freed_heap()
        model.eval()
        g.release_pages()
    except GGUFError as exc:
        raise ModelFileError(str(exc)) from exc
    return LoadedModel(model, cfg, g, dtype, time.perf_counter() - start, "gguf" if mode == "gguf" else "dense",
                       target)


def _weight(info, mode: str, dtype: torch.dtype, int4: bool) -> GGUFWeight:
    if len(info.shape) == 2 and mode == "gguf":
        return GGUFWeight(raw=RawTensor(info.data, info.ggml_type, info.shape))
    packed = Int4Weight.from_gguf(info.data, info.ggml_type, info.shape) if int4 and len(info.shape) == 2 else None
    return GGUFWeight(dense=dequantize(info, dtype), int4=packed)
