"""Logprobs (kernels.logprobs) on every variant this CPU runs, against torch's logsumexp and
log_softmax: equal within float32 rounding of the row's log-sum-exp, top ids identical where the
reference has no ties, a row's values the same alone and in a batch. Awkward rows: vocabularies that
are not a multiple of the kernel's block of 64, all -inf, a +inf, a NaN, huge and tiny magnitudes,
strided rows, k of 0 and above the vocabulary."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.logprobs import logsumexp_rows, logsumexp_rows_reference, row_logprobs, row_logprobs_reference

VARIANTS = [*native.runnable_variants(), "torch"]
NAN, INF = float("nan"), float("inf")


def run(fn, *args, variant: str, threads: int = 2):
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            return fn(*args)
    finally:
        native.set_num_threads(torch.get_num_threads())


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    # A few ulps of the log-sum-exp: the kernel's exp and float64 sum round differently from torch's.
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,cols", [(64, 49152), (1, 262144), (3, 1000), (2, 7), (1, 1), (5, 64 * 256 + 3)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_logsumexp_of_random_rows(variant, rows, cols, threads):
    gen = torch.Generator().manual_seed(rows * cols + threads)
    x = torch.randn(rows, cols, generator=gen) * 4
    got = run(logsumexp_rows, x, variant=variant, threads=threads)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    close(got, logsumexp_rows_reference(x))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logsumexp_of_extreme_rows(variant):
    x = torch.full((8, 130), -INF)
    x[1, 77] = 3.5                          # one finite logit among -inf: exactly it
    x[2, :] = 1e30                          # huge and equal: 1e30 + log(130) rounds back to 1e30
    x[3, :] = -1e30
    x[4, 5] = INF                           # a +inf logit: +inf
    x[5, :] = 0.0
    x[5, 64] = NAN                          # a NaN anywhere: NaN
    x[6, :] = torch.linspace(-200, 50, 130)  # most of the row underflows next to the max
    x[7, :64] = 2.0                         # a full block and a tail of -inf
    got = run(logsumexp_rows, x, variant=variant)
    ref = logsumexp_rows_reference(x)
    assert got[0] == -INF and got[4] == INF and got[5].isnan()
    assert got[1] == 3.5 and got[2] == 1e30 and got[3] == -1e30
    close(got, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows(variant):
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    x = wide[:, 10:210]
    assert x.stride(0) == 300
    close(run(logsumexp_rows, x, variant=variant), logsumexp_rows_reference(x.contiguous()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_row_logprobs_match_log_softmax(variant, k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(16, 5000, generator=gen) * 3
    tokens = torch.randint(0, 5000, (16,), generator=gen)
    chosen, values, ids = run(row_logprobs, x, tokens, k, variant=variant)
    ref_chosen, ref_values, ref_ids = row_logprobs_reference(x, tokens, k)
    close(chosen, ref_chosen)
    assert values.shape == ids.shape == (16, k) and ids.dtype == torch.int64
    close(values, ref_values)
    assert torch.equal(ids, ref_ids)  # random normals: no ties
    if variant != "torch":  # a top value is its logit minus the row's log-sum-exp, as a chosen one
        assert torch.equal(x.gather(1, ids) - logsumexp_rows(x)[:, None], values)


@pytest.mark.parametrize("variant", VARIANTS)
def test_k_above_the_vocabulary_and_ties(variant):
    x = torch.tensor([[1.0, 3.0, 3.0, -INF], [0.0, 0.0, 0.0, 0.0]])
    chosen, values, ids = run(row_logprobs, x, torch.tensor([1, 3]), 10, variant=variant)
    assert values.shape == (2, 4)
    if variant != "torch":
        assert ids.tolist() == [[1, 2, 0, 3], [0, 1, 2, 3]]  # equal logits: the lower id first
    close(chosen, torch.log_softmax(x, -1)[[0, 1], [1, 3]])
    assert values[0, 3] == -INF


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_has_the_same_logprobs_alone_and_in_a_batch(variant):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 49152, generator=gen) * 5
    tokens = torch.randint(0, 49152, (9,), generator=gen)
    batch = run(row_logprobs, x, tokens, 5, variant=variant, threads=2)
    for r in (0, 4, 8):
        alone = run(row_logprobs, x[r:r + 1].clone(), tokens[r:r + 1], 5, variant=variant, threads=1)
        for a, b in zip(alone, batch):
            assert torch.equal(a[0], b[r])
