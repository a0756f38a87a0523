"""Greedy sampling's argmax (kernels.argmax) on every variant this CPU runs, against torch.max(dim=-1):
exactly the same indices. Awkward rows: ties (the first index wins, also across the segments a row
is cut into when there are fewer rows than threads), NaNs (the first NaN wins), all -inf, -0.0
against 0.0, +inf, lengths that are not a multiple of the vector width, and strided rows."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.argmax import argmax_rows, argmax_rows_reference

VARIANTS = [*native.runnable_variants(), "torch"]
NAN, INF = float("nan"), float("inf")


def check(logits: torch.Tensor, variant: str, threads: int = 2) -> torch.Tensor:
    expected = argmax_rows_reference(logits)
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            got = argmax_rows(logits)
    finally:
        native.set_num_threads(torch.get_num_threads())
    assert got.dtype == torch.int64
    assert torch.equal(got, expected), (got, expected)
    return got


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,cols", [(64, 49152), (1, 262144), (3, 1000), (2, 7), (1, 1), (5, 16 * 1024 + 3)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_random_rows(variant, rows, cols, threads):
    gen = torch.Generator().manual_seed(rows * cols + threads)
    check(torch.randn(rows, cols, generator=gen), variant, threads)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ties_take_the_first_index_even_across_segments(variant):
    cols = 100_003
    x = torch.full((2, cols), -1.0)
    x[0, [5, 70_000, 99_999]] = 3.0          # the first of three equal maxima, in different segments
    x[1, [60_000, 99_000]] = 2.0             # both in the second half of a row cut in two
    assert check(x, variant).tolist() == [5, 60_000]


@pytest.mark.parametrize("variant", VARIANTS)
def test_special_values(variant):
    cols = 41
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(0))
    x[0, [3, 30]] = NAN                      # the first NaN, wherever the maximum is
    x[0, 1] = INF
    x[1] = -INF                              # all -inf: index 0
    x[2] = 0.0
    x[2, :4] = -0.0                          # -0.0 ties 0.0: index 0
    x[3, [17, 40]] = INF
    x[4, 40] = NAN                           # a NaN in the scalar tail
    x[5, 16] = 1e30                          # the maximum at a vector boundary
    x[6] = -1e30
    assert check(x, variant).tolist()[:5] == [3, 0, 0, 17, 40]
    big = torch.randn(2, 1 << 16, generator=torch.Generator().manual_seed(1))
    big[0, 50_000] = NAN                     # NaN in the second segment beats a larger first one
    big[0, 10] = 1e9
    big[1, :] = -INF
    big[1, 40_000] = NAN
    assert check(big[:1], variant).tolist() == [50_000]   # one row: cut into segments on 2 threads
    assert check(big[1:], variant).tolist() == [40_000]


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_and_other_inputs(variant):
    base = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    check(base[::2, :257], variant)          # rows further apart than their length
    check(base.t(), variant)                 # not unit stride: torch's path
    check(base.to(torch.bfloat16), variant)  # not float32: torch's path
    check(base[:0], variant)                 # no rows
