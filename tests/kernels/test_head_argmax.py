"""csrc/head_argmax.cpp against its twin, the first index of each row's largest logit from the full
qmatmul: random heads (real Q8_0 quantization), exact ties (duplicated columns), heads whose columns
all lie within the bound of each other (every tile a candidate), a partial last tile, a head as wide
as a vocabulary, zero activations, and a column whose scale is infinite (the row then takes every
tile exactly); 1 and 2 threads; every variant (those without the kernel take the full logits); each with
and without the head's 6-bit copy (one-row calls scan it instead of the Q8_0 bytes), and with columns
excluded (the ids a row suppresses)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.head_argmax import COARSE_HEAD_SHARE, GreedyHead, coarse_copy_bytes, head_argmax_reference
from tokenmill.kernels.argmax import excluding
from tokenmill.kernels.qmatmul import QuantizedWeight, qmatmul

Q = gguf.GGMLQuantizationType
VARIANTS = ["torch"] + native.runnable_variants()


def q8_head(values: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(values.astype(np.float32), Q.Q8_0)


def head(raw: np.ndarray, n: int, k: int) -> QuantizedWeight:
    return QuantizedWeight.from_gguf(raw, Q.Q8_0, (n, k))


def check(w: QuantizedWeight, x: torch.Tensor, variant: str) -> None:
    with native.use_variant(variant):
        expected = qmatmul(x, w).max(dim=-1).indices
        for coarse in (False, True):
            h = GreedyHead(w, coarse=coarse)
            assert h.native == (variant == "avx512")
            assert (h.coarse is not None) == (coarse and h.native)
            for threads in (1, 2):
                native.set_num_threads(threads)
                try:
                    assert torch.equal(h(x), expected), f"{variant}, coarse {coarse}, {threads} threads"
                    for m in range(min(len(x), 3)):  # one row at a time: the 6-bit copy's calls
                        assert torch.equal(h(x[m:m + 1]), expected[m:m + 1]), f"{variant}, coarse {coarse}, row {m}"
                    # Suppressed ids (excluded columns): the first and last rows' tokens, and the last column.
                    exclude = tuple(sorted({int(expected[0]), int(expected[-1]), w.out_features - 1}))
                    without = excluding(qmatmul(x, w), exclude).max(dim=-1).indices
                    assert torch.equal(h(x, exclude), without), f"{variant}, coarse {coarse}, excluding {exclude}"
                    assert torch.equal(h(x[:1], exclude), without[:1])
                    assert torch.equal(head_argmax_reference(x, w, exclude), without)
                finally:
                    native.set_num_threads(torch.get_num_threads())
        assert torch.equal(head_argmax_reference(x, w), expected)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 64), (1000, 96), (16384 + 24, 64)])
def test_random_heads(variant, n, k):
    rng = np.random.default_rng(n + k)
    w = head(q8_head(rng.standard_normal((n, k)) * 0.05), n, k)
    for m in (1, 2, 3, 5, 9, 17, 50):  # 50: the full head on AMX where the CPU has it (the same bits)
        check(w, torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_exact_ties_take_the_first_index(variant):
    rng = np.random.default_rng(1)
    n, k = 2000, 64
    values = rng.standard_normal((n, k)) * 0.05
    values[5] *= 4  # far ahead of the others for the row below ...
    values[[700, 1500, 1999]] = values[5]  # ... and three exact copies after it
    w = head(q8_head(values), n, k)
    x = torch.from_numpy(values[5:6] / np.abs(values[5]).max()).float().repeat(3, 1)
    logits = qmatmul(x, w)
    assert logits[0, 5] == logits[0, 700] == logits[0, 1999] == logits[0].max()
    check(w, x, variant)
    with native.use_variant(variant):
        assert GreedyHead(w)(x).tolist() == [5, 5, 5]


@pytest.mark.parametrize("variant", VARIANTS)
def test_columns_all_within_the_bound(variant):
    # Every column the same but for one input: the coarse pass cannot rule any tile out.
    rng = np.random.default_rng(2)
    n, k = 3000, 128
    values = np.tile(rng.standard_normal(k) * 0.05, (n, 1))
    values[:, 7] += rng.standard_normal(n) * 1e-3
    w = head(q8_head(values), n, k)
    check(w, torch.randn(4, k, generator=torch.Generator().manual_seed(3)), variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_activations_and_an_infinite_scale(variant):
    rng = np.random.default_rng(4)
    n, k = 500, 64
    raw = q8_head(rng.standard_normal((n, k)) * 0.05)
    w = head(raw, n, k)
    check(w, torch.zeros(2, k), variant)  # every logit 0: the first column
    odd = raw.copy()
    odd[37, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # column 37's first block scale
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    x[1, :32] = 0  # that row's product with the infinite block is a NaN (0 * inf)
    check(head(odd, n, k), x, variant)


def test_norms_bound_every_column():
    # block_norms: per block, the largest |scale| * sum |q| over the columns, from the repacked head.
    if len(VARIANTS) == 1:
        pytest.skip("no native variant built")
    rng = np.random.default_rng(6)
    n, k = 77, 96
    raw = q8_head(rng.standard_normal((n, k)) * 0.05)
    blocks = raw.reshape(n, k // 32, 34)
    scale = np.abs(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    l1 = np.abs(blocks[..., 2:].view(np.int8).astype(np.int32)).sum(-1)
    expected = (scale * l1).max(0)
    for variant in VARIANTS[1:]:
        with native.use_variant(variant):
            w = head(raw, n, k)
            out = torch.empty(k // 32)
            native.module().head_block_norms(w.qs.data_ptr(), w.sc.data_ptr(), n, k, out.data_ptr())
            assert np.allclose(out.numpy(), expected, rtol=1e-6), variant


def test_coarse_copy_holds_the_top_six_bits():
    # head_coarse_pack: each value's u >> 2 (u = q + 128), in Q6_K's layout: step j's low four bits in the
    # nibbles of bytes 64 (j % 4) + i (high nibble from step 4), its top two in bits 2 (j % 4) of byte
    # 256 + 64 (j // 4) + i.
    if "avx512" not in VARIANTS:
        pytest.skip("the 6-bit copy is the avx512 variant's")
    rng = np.random.default_rng(7)
    n, k = 40, 96
    with native.use_variant("avx512"):
        w = head(q8_head(rng.standard_normal((n, k)) * 0.05), n, k)
        copy = GreedyHead(w, coarse=True).coarse.numpy().reshape(-1, 384).astype(np.int32)
    u = w.qs.numpy().reshape(-1, 8, 64).astype(np.int32)  # [tile block, step, byte]: Q8_0's u
    assert len(copy) == len(u)
    for j in range(8):
        nib = copy[:, 64 * (j % 4):64 * (j % 4) + 64]
        nib = nib & 15 if j < 4 else nib >> 4
        top = (copy[:, 256 + 64 * (j // 4):256 + 64 * (j // 4) + 64] >> (2 * (j % 4))) & 3
        assert np.array_equal(nib | top << 4, u[:, j] >> 2), f"step {j}"


def test_coarse_copy_only_for_heads_that_are_most_of_the_weights():
    q8 = int(Q.Q8_0)
    head_bytes = 262144 * 20 * 34  # Gemma 3's head: 170 MiB of ~250
    assert coarse_copy_bytes(q8, 262144, 640, head_bytes, int(head_bytes / 0.7)) == 16384 * 20 * 384
    assert coarse_copy_bytes(q8, 262144, 640, head_bytes, int(head_bytes / COARSE_HEAD_SHARE) + 10) == 0
    assert coarse_copy_bytes(int(Q.Q6_K), 262144, 640, head_bytes, head_bytes) == 0  # Q8_0 heads only
    assert coarse_copy_bytes(q8, 49152, 576, 30 << 20, 140 << 20) == 0  # SmolLM2's: a fifth of its bytes
