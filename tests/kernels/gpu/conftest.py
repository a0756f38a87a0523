"""The Triton kernels run here on CPU tensors through Triton's interpreter, unless a CUDA device is
present (then they run compiled, on it). Triton picks interpreted or compiled for good when
triton.language is first imported, so TRITON_INTERPRET=1 is set as this file is imported, before any
test here imports triton. On a machine without CUDA nothing else can run a Triton kernel, so the
setting harms no other test in the process; with CUDA it is never set."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns a scalar (a 1-element array) into a loop bound with int(array),
    which numpy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6 by #9172): do what the fix does."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.array([1]))
        return  # an older numpy still converts
    except TypeError:
        pass
    if getattr(interpreter._patch_lang_tensor, "tokenmill_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.tokenmill_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests put their tensors: "cuda", or "cpu" under the interpreter."""
    pytest.importorskip("triton")
    if CUDA:
        return "cuda"
    from tokenmill.kernels.gpu.dispatch import interpreting

    if not interpreting():
        pytest.skip("triton was imported (compiled) before tests/kernels/gpu/conftest.py could set "
                    "TRITON_INTERPRET=1; run tests/kernels/gpu on its own")
    _patch_interpreter_for_numpy_2_4()
    return "cpu"
