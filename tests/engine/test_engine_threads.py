"""Engines apply the process-wide thread choice (cpu_threads.configure_threads): the native pool's
count, and torch's share (1 while every engine runs its step natively, the count once one runs in
torch); an engine asking for the default keeps an explicit count set before it."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_helpers import make_engine, random_ids, run_to_completion
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill import cpu_threads
from tokenmill.engine import SamplingParams
from tokenmill.engine.engine import step_runs_natively
from tokenmill.kernels import native
from tokenmill.model import load_model

native_only = pytest.mark.skipif(native.module() is None, reason="the compiled core is not built")


@pytest.fixture(autouse=True)
def fresh_choice():
    saved = torch.get_num_threads()
    native_saved = native.module().num_threads() if native.module() is not None else None
    cpu_threads._reset_for_tests()
    yield
    cpu_threads._reset_for_tests()
    torch.set_num_threads(saved)
    if native_saved is not None:
        native.set_num_threads(native_saved)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny model with Q8_0 weights in the gguf mode: every step runs in the native core."""
    path = write_tiny_llama(tmp_path_factory.mktemp("q") / "tiny-q8.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0))
    return load_model(path, "gguf")


@pytest.fixture(scope="module")
def dense(tiny_gguf):
    return load_model(tiny_gguf, torch.float32)


def generates(engine) -> None:
    out = run_to_completion(engine, [(random_ids(5), SamplingParams(max_tokens=3, temperature=0))])
    assert len(out[0]) == 3


def test_which_steps_run_natively(quantized, dense):
    assert step_runs_natively(quantized) == (native.module() is not None)
    assert not step_runs_natively(dense)


@native_only
def test_native_engine_gives_torch_one_thread(quantized):
    engine = make_engine(quantized)
    default = cpu_threads.default_threads()
    assert engine.threads == default == cpu_threads.current_threads()
    assert native.module().num_threads() == default.count
    assert torch.get_num_threads() == 1
    generates(engine)


def test_torch_engine_keeps_every_thread(dense, quantized):
    make_engine(dense, threads=3)
    assert torch.get_num_threads() == 3
    if native.module() is not None:
        assert native.module().num_threads() == 3
    # a native engine loaded beside it: torch must keep the count for the dense one
    generates(make_engine(quantized))
    assert torch.get_num_threads() == 3


def test_reference_path_keeps_every_thread(quantized):
    with native.use_variant("torch"):
        assert not step_runs_natively(quantized)
        make_engine(quantized, threads=2)
        assert torch.get_num_threads() == 2


def test_second_engine_with_the_default_keeps_an_explicit_count(quantized):
    first = make_engine(quantized, threads=3)
    assert first.threads.count == 3 and first.threads.explicit
    second = make_engine(quantized)  # threads=0: a model a server loads on demand
    assert second.threads == first.threads
    if native.module() is not None:
        assert native.module().num_threads() == 3
    third = make_engine(quantized, threads=1)  # the last explicit count wins, for the whole process
    assert third.threads.count == 1 and cpu_threads.current_threads().count == 1
    generates(first)  # the earlier engines run on, on the new count
