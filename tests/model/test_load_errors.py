"""Loading failures name the problem instead of surfacing a stack trace from deep inside."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tiny_model import write_tiny_llama
from tokenmill.cli import main
from tokenmill.model import ModelLoadError, load_model


def test_unsupported_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'.*supported: llama"):
        load_model(path)


def test_unsupported_quantization_type(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    # A tensor stored as IQ2_XXS, a type the loader does not dequantize.
    raw = np.zeros((4, 66), dtype=np.uint8)
    w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported type IQ2_XXS"):
        load_model(path)


def test_truncated_file(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncat|corrupt"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path)


def test_missing_tensor(tmp_path):
    """Metadata promises a layer; the file holds only the embedding. (A layer count above the file's
    tensor count is refused earlier, by the config's checks, before a model is built from it.)"""
    g = gguf.GGUFWriter(str(tmp_path / "two.gguf"), "llama")
    g.add_block_count(1)
    g.add_context_length(64)
    g.add_embedding_length(64)
    g.add_feed_forward_length(128)
    g.add_head_count(4)
    g.add_vocab_size(8)
    g.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    with pytest.raises(ModelLoadError, match="missing tensors"):
        load_model(tmp_path / "two.gguf", torch.float32)


def test_cli_run_reports_a_bad_file_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 10)
    assert main(["run", str(path), "hi"]) == 1
    # One line says where it runs (in-process, for a path), one says what is wrong.
    where, error = capsys.readouterr().err.strip().splitlines()
    assert where.startswith("running ") and "in-process" in where
    assert error.startswith("error: ") and "Traceback" not in error
