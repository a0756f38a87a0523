"""Which implementation an op runs: the Triton kernel for CUDA tensors when triton is installed, the
PyTorch reference otherwise (CPU tensors, no triton, or TOKENMILL_TRITON=0).

The kernel modules import triton at their top, so they are imported lazily, on first use: importing
tokenmill.kernels.gpu never needs triton. Tests run the kernels on CPU tensors with `force("triton")`
in a process where TRITON_INTERPRET=1 was set before triton was first imported (triton decides
compiled vs interpreted when @triton.jit runs, its own standard library's functions included, so the
choice is made once per process; tests/kernels/gpu/conftest.py arranges it)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType

import torch

MODES = ("auto", "reference", "triton")
_mode = "auto"


@functools.cache
def triton_available() -> bool:
    """triton is installed and imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


@contextlib.contextmanager
def force(mode: str) -> Iterator[None]:
    """Within the block, every op takes `mode`: "reference", "triton" (the kernels on whatever tensors
    come: CPU tensors need Triton's interpreter), or "auto" (the default)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "triton" and not triton_available():
        raise RuntimeError(f"mode {mode!r} needs triton, which is not installed")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on this tensor runs its Triton kernel."""
    if _mode == "reference":
        return False
    if _mode == "triton":
        return True
    return tensor.is_cuda and os.environ.get("TOKENMILL_TRITON", "1") != "0" and triton_available()


def interpreting() -> bool:
    """Whether triton's kernels run through its interpreter in this process (TRITON_INTERPRET=1 when
    triton.language was first imported: its own functions are interpreted or compiled from then on)."""
    if not triton_available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


def kernel_module(name: str) -> ModuleType:
    """tokenmill.kernels.gpu.<name>, imported on first use (it imports triton)."""
    return importlib.import_module(f"{__package__}.{name}")
