"""The dual-form linear layer: GGUF 4-bit blocks -> int4-packed weights, used for few-row calls."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from model_helpers import BLOCK, new_cache
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.model import AttentionMetadata, ChunkSpec, load_model
from tokenmill.model.linear import INT4_MAX_ROWS, Int4Weight, Linear

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_decode_exactly(qtype):
    w = np.random.default_rng(0).normal(0, 0.05, (96, 128)).astype(np.float32)
    data = quants.quantize(w, qtype)
    int4 = Int4Weight.from_gguf(data, qtype, (96, 128))
    assert torch.equal(int4.dequantize(), torch.from_numpy(quants.dequantize(data, qtype)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_path_matches_dense_for_few_rows_and_is_skipped_for_many(qtype):
    w = np.random.default_rng(1).normal(0, 0.05, (256, 192)).astype(np.float32)
    data = quants.quantize(w, qtype)
    dense = torch.from_numpy(quants.dequantize(data, qtype))
    lin = Linear(256, 192)
    lin.weight.data = dense.to(torch.bfloat16)
    lin.set_int4(Int4Weight.from_gguf(data, qtype, (256, 192)))
    assert lin.int4 is not None
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 32):
        x = torch.randn(rows, 192, dtype=torch.bfloat16)
        ref = x.float() @ dense.T
        got = lin(x).float()
        # Both forms round to bf16 somewhere; they must agree with fp32 to bf16 accuracy.
        assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_int4_needs_bf16():
    lin = Linear(64, 64)  # fp32 weight
    w = np.zeros((64, 64), np.float32)
    lin.set_int4(Int4Weight.from_gguf(quants.quantize(w, Q.Q4_1), Q.Q4_1, (64, 64)))
    assert lin.int4 is None


@torch.inference_mode()
def test_model_decode_with_int4_close_to_dense(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", TinyLlamaSpec(weight_type=Q.Q4_1))
    with_int4 = load_model(path, torch.bfloat16, int4=True).model
    dense = load_model(path, torch.bfloat16, int4=False).model
    assert sum(getattr(m, "int4", None) is not None for m in with_int4.modules()) == 2 * 4
    ids = [5, 77, 100, 3, 250, 9, 42]
    outs = []
    for model in (with_int4, dense):
        kv, table = new_cache(model.config, 32, torch.bfloat16)
        model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.build([ChunkSpec(table, 0, len(ids))], BLOCK), kv)
        h = model(torch.tensor([11]), torch.tensor([len(ids)]), AttentionMetadata.build([ChunkSpec(table, len(ids), 1)], BLOCK), kv)
        outs.append(model.logits(h))
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[1].abs().max()


def test_packed_weights_are_used_and_freed_with_their_model(tiny_gguf):
    import gc

    from tokenmill.model import linear

    if not linear.onednn_bf16_available():
        pytest.skip("oneDNN bf16 is not available on this CPU")
    before = len(linear._PACKED)
    model = load_model(tiny_gguf, torch.bfloat16).model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in layers) and model.lm_head_packed is not None
    assert len(linear._PACKED) == before + len(layers) + 1
    x = torch.randn(3, layers[0].weight.shape[1], dtype=torch.bfloat16)
    assert torch.allclose(layers[0](x).float(), (x @ layers[0].weight.T).float(), atol=1e-2, rtol=1e-2)
    del model, layers
    gc.collect()
    assert len(linear._PACKED) == before


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0])
def test_embedding_rows_are_gguf_dequantization_exactly(qtype):
    """The step's token lookup dequantizes only the rows asked for (Q8_0 by its own short path)."""
    from tokenmill.model.quantized import EmbeddingRows, RawTensor
    w = np.random.default_rng(2).normal(0, 0.05, (40, 256)).astype(np.float32)
    w[3] = 0.0  # a zero scale
    w[5, :32] *= 1e4
    data = quants.quantize(w, qtype)
    table = EmbeddingRows(RawTensor(data, qtype, (40, 256)))
    ids = torch.tensor([5, 3, 5, 39, 0])
    expected = torch.from_numpy(quants.dequantize(data, qtype))[ids]
    assert torch.equal(table(ids), expected)
