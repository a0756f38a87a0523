"""LoRA adapters in llama.cpp's GGUF form (what its convert_lora_to_gguf.py writes from a PEFT
folder, and what `ollama create` takes as ADAPTER): `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`, and per adapted weight `<base tensor>.lora_a` (rank x inputs) and
`<base tensor>.lora_b` (outputs x rank), named and ordered as the base file's own tensors (q and k
rows already permuted as the base's are), so W' = W + alpha / rank * B @ A row for row.

tokenmill merges an adapter into its base once, when a model is created with it (store/adapters.py),
rather than adding B @ A x to every matmul as llama.cpp does: the merged file is an ordinary GGUF that
every loader path runs. A merged weight is stored as Q8_0 (F32 and F16 bases keep their type): the
base's weights lie on its 4- or 5-bit grid, and requantized to it a weight moved by less than half a
step would round back where it was; Q8_0's rounding (about 0.4% of a block's largest weight) is what a
Q8_0 model has. The price is the bytes: an adapted 4-bit model decodes slower than its base.

Every check names tensors, never the files' paths."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import quants

from tokenmill.gguf.reader import GGUFError, GGUFFile, TensorInfo
from tokenmill.gguf.weights import dequantize

Q = gguf.GGMLQuantizationType
ADAPTER_TYPE = "adapter"
# llama.cpp skips adapter tensors of norms (some converters emit them); every other name must be a pair.
_SKIPPED_SUFFIX = "_norm.weight"
# Types a merged weight keeps: float bases stay float; every block type becomes Q8_0.
_FLOAT_TYPES = (Q.F32, Q.F16)


class AdapterError(GGUFError):
    """The adapter cannot be applied to this base; the message says why."""


@dataclass(frozen=True)
class LoraPair:
    base: str          # the base tensor it adapts ("blk.0.attn_q.weight")
    a: TensorInfo      # [rank, inputs]
    b: TensorInfo      # [outputs, rank]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    architecture: str
    alpha: float
    pairs: tuple[LoraPair, ...]

    def scale(self, rank: int) -> float:
        """llama.cpp's: alpha / rank, or 1 for an adapter without alpha (alpha 0 there means none)."""
        return self.alpha / rank if self.alpha else 1.0


def is_adapter(g: GGUFFile) -> bool:
    return g.get("general.type") == ADAPTER_TYPE


def read_adapter(g: GGUFFile) -> LoraAdapter:
    """The adapter in an opened GGUF, its structure checked (not yet against a base: check_fits)."""
    if not is_adapter(g):
        raise AdapterError("not a LoRA adapter: general.type is not 'adapter'")
    kind = g.get("adapter.type")
    if kind != "lora":
        raise AdapterError(f"adapter.type is {str(kind)[:40]!r}; only 'lora' adapters are supported")
    if g.get("adapter.alora.invocation_tokens") is not None:
        raise AdapterError("activated LoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = g.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
        raise AdapterError("adapter.lora.alpha is not a number")
    halves: dict[str, dict[str, TensorInfo]] = {}
    for name, t in g.tensors.items():
        base, _, half = name.rpartition(".")
        if half not in ("lora_a", "lora_b"):
            raise AdapterError(f"adapter tensor {name[:80]!r} is not named <tensor>.lora_a or <tensor>.lora_b")
        if base.endswith(_SKIPPED_SUFFIX):
            continue
        if len(t.shape) != 2:
            raise AdapterError(f"adapter tensor {name!r} has {len(t.shape)} dimensions, not 2")
        halves.setdefault(base, {})[half] = t
    pairs = []
    for base, h in halves.items():
        if len(h) != 2:
            missing = "lora_b" if "lora_a" in h else "lora_a"
            raise AdapterError(f"adapter tensor {base}.{missing} is missing")
        a, b = h["lora_a"], h["lora_b"]
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{base}: lora_a has rank {a.shape[0]} but lora_b has rank {b.shape[1]}")
        pairs.append(LoraPair(base, a, b))
    if not pairs:
        raise AdapterError("the adapter adapts no tensor")
    return LoraAdapter(g.architecture, float(alpha), tuple(pairs))


def check_fits(adapter: LoraAdapter, base: GGUFFile) -> None:
    """Raises AdapterError unless every pair adapts a 2-D weight of `base` with matching shapes."""
    if adapter.architecture != base.architecture:
        raise AdapterError(f"the adapter is for architecture {adapter.architecture[:40]!r}, the base model is "
                           f"{base.architecture!r}")
    for p in adapter.pairs:
        w = base.tensors.get(p.base)
        if w is None:
            raise AdapterError(f"the adapter adapts {p.base[:80]!r}, which the base model does not have")
        if p.base == "token_embd.weight":
            raise AdapterError("adapters of the token embeddings (token_embd.weight) are not supported")
        if len(w.shape) != 2:
            raise AdapterError(f"{p.base} is not a matrix in the base model")
        outputs, inputs = w.shape
        if p.a.shape[1] != inputs or p.b.shape[0] != outputs:
            raise AdapterError(f"{p.base}: the adapter's lora_b x lora_a is {p.b.shape[0]} x {p.a.shape[1]}, "
                               f"the base weight {outputs} x {inputs}")
        if not 1 <= p.rank <= min(outputs, inputs):
            raise AdapterError(f"{p.base}: rank {p.rank} is not between 1 and {min(outputs, inputs)}")


@dataclass(frozen=True)
class MergedTensor:
    """A tensor that replaces a base's: its type and shape known at once, its data made when asked (as the
    rewrite reaches it), so a merge holds one tensor's floats at a time, not every adapted weight's."""
    ggml_type: Q
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]   # the bytes (or float elements) as a GGUF stores them, rows first

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block * size


def merge(base: GGUFFile, adapters: list[LoraAdapter]) -> dict[str, MergedTensor]:
    """The adapted tensors of `base`, by name, each the dequantized weight with every adapter's B @ A
    added (in order, each at its scale); the base's other tensors are unchanged. Each adapter must have
    passed check_fits. Made lazily: AdapterError (an update that is not finite) comes from `make`."""
    uses: dict[str, list[tuple[float, LoraPair]]] = {}
    for adapter in adapters:
        for p in adapter.pairs:
            uses.setdefault(p.base, []).append((adapter.scale(p.rank), p))
    out = {}
    for name, pairs in uses.items():
        info = base.tensors[name]
        kind = _stored_type(info.ggml_type, info.shape[1])
        out[name] = MergedTensor(kind, info.shape, functools.partial(_merged, info, pairs, kind))
    return out


def _stored_type(base_type: Q, inputs: int) -> Q:
    if base_type in _FLOAT_TYPES:
        return base_type
    return Q.F32 if inputs % 32 else Q.Q8_0  # Q8_0 takes rows in blocks of 32


def _merged(info: TensorInfo, pairs: list[tuple[float, LoraPair]], kind: Q) -> np.ndarray:
    w = dequantize(info, torch.float32)
    for scale, p in pairs:
        delta = (dequantize(p.b, torch.float32) @ dequantize(p.a, torch.float32)).mul_(scale)
        if not torch.isfinite(delta).all():
            raise AdapterError(f"{p.base}: the adapter's update is not finite")
        w.add_(delta)
    merged = w.numpy()
    if kind == Q.F16:
        if not np.abs(merged).max(initial=0.0) < 65504:
            raise AdapterError(f"{info.name}: the adapted weights overflow its F16 type")
        return merged.astype(np.float16)
    return merged if kind == Q.F32 else quants.quantize(merged, Q.Q8_0)


def write_adapter(path, architecture: str, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                  alpha: float | None = None, extra: dict[str, np.ndarray] | None = None) -> None:
    """Write an adapter in this form: `pairs` maps a base tensor's name to its (A [rank, inputs],
    B [outputs, rank]) as float arrays (tests and the peer benchmark make random ones); `extra`
    tensors are written as they are (what other converters add, or a test's broken ones)."""
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_string("general.type", ADAPTER_TYPE)
    w.add_string("adapter.type", "lora")
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for name, (a, b) in pairs.items():
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
