"""Q8_0 token embedding rows (kernels.embedding) on every variant this CPU runs, against gguf's own
arithmetic: bitwise the same rows, whatever the scales (subnormal, huge, zero, negative, inf, NaN)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tokenmill.kernels import native
from tokenmill.kernels.embedding import embed_rows_q8_0, embed_rows_q8_0_reference

VARIANTS = [*native.runnable_variants(), "torch"]


def q8_0_table(vocab: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = np.empty((vocab, dim // 32, 34), dtype=np.uint8)
    table[:, :, 2:] = rng.integers(0, 256, (vocab, dim // 32, 32), dtype=np.uint8)
    scales = rng.standard_normal((vocab, dim // 32)).astype(np.float16)
    # Awkward scales in the first rows: subnormal, the largest half, zero, -0, inf, NaN.
    special = np.array([6e-8, 65504.0, 0.0, -0.0, np.inf, np.nan], dtype=np.float16)
    flat = scales.reshape(-1)
    flat[:min(special.size, flat.size)] = special[:flat.size]
    table[:, :, :2] = scales[..., None].view(np.uint8).reshape(vocab, dim // 32, 2)
    return table.reshape(vocab, -1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_are_bitwise_ggufs_dequantization(variant):
    vocab, dim = 50, 96
    table = q8_0_table(vocab, dim)
    ids = torch.tensor([0, 49, 3, 3, 17, 0])
    with native.use_variant(variant):
        got = embed_rows_q8_0(table, ids, dim)
    want = embed_rows_q8_0_reference(table, ids, dim)
    assert got.shape == (6, dim) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaNs included, bit for bit
    gguf_rows = quants.dequantize(table[ids.numpy()], GGMLQuantizationType.Q8_0).reshape(6, dim)
    assert np.array_equal(got.numpy().view(np.int32), gguf_rows.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_id_outside_the_vocabulary_is_refused(variant):
    table = q8_0_table(4, 32)
    with native.use_variant(variant), pytest.raises(IndexError):
        embed_rows_q8_0(table, torch.tensor([1, 4]), 32)


def test_no_rows():
    assert embed_rows_q8_0(q8_0_table(4, 32), torch.tensor([], dtype=torch.int64), 32).shape == (0, 32)
