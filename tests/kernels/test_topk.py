"""Sampling's top_k (kernels.topk) on every variant this CPU runs, against torch.topk: exactly the same
values, ids that hold them, and among equal values ascending ids (torch leaves that order open, so
ids are compared with torch's only where its values have no ties). Awkward rows: fewer finite values
than k, all values equal, a NaN (the call falls back to torch), strided rows, k above the kernel's
limit, rows cut into segments for more threads than rows."""
from __future__ import annotations

import types

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.topk import MAX_K, topk_rows, topk_rows_reference

VARIANTS = [*native.runnable_variants(), "torch"]
NAN, INF = float("nan"), float("inf")


def run(logits: torch.Tensor, k: int, variant: str, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            return topk_rows(logits, k)
    finally:
        native.set_num_threads(torch.get_num_threads())


def check(logits: torch.Tensor, k: int, variant: str, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ref_values, ref_ids = topk_rows_reference(logits, k)
    values, ids = run(logits, k, variant, threads)
    assert values.dtype == logits.dtype and ids.dtype == torch.int64
    assert values.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(values, ref_values)
    assert torch.equal(logits.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist())
    tied = values[:, 1:] == values[:, :-1]
    if variant != "torch":  # torch's own order among ties is its business
        assert not (tied & (ids[:, 1:] <= ids[:, :-1])).any()
    ref_tied = torch.zeros_like(ref_values, dtype=torch.bool)
    ref_tied[:, 1:] |= ref_values[:, 1:] == ref_values[:, :-1]
    ref_tied[:, :-1] |= ref_values[:, 1:] == ref_values[:, :-1]
    untied_rows = ~ref_tied.any(dim=1)
    assert torch.equal(ids[untied_rows], ref_ids[untied_rows])
    return values, ids


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,cols", [(64, 49152), (1, 262144), (3, 1000), (2, 7), (1, 1), (5, 16 * 1024 + 3)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_random_rows(variant, rows, cols, threads):
    gen = torch.Generator().manual_seed(rows * cols + threads)
    x = torch.randn(rows, cols, generator=gen)
    for k in sorted({1, 40, 64, 256, MAX_K}):
        if k <= cols:
            check(x, k, variant, threads)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ties_and_ascending_rows(variant):
    cols = 70_001
    x = torch.randint(-3, 4, (4, cols), generator=torch.Generator().manual_seed(3)).float()  # every value tied
    x[2] = torch.arange(cols, dtype=torch.float32)           # ascending: every value survives the threshold
    x[3] = -torch.arange(cols, dtype=torch.float32)
    for threads in (1, 2, 3):
        for k in (1, 40, 256):
            values, ids = check(x, k, variant, threads)
            if variant != "torch":
                assert ids[0].tolist() == (x[0] == 3).nonzero().flatten()[:k].tolist()
            assert ids[2].tolist() == list(range(cols - 1, cols - 1 - k, -1))
            assert ids[3].tolist() == list(range(k))
    check(x[2:3], 64, variant, 3)                            # one row cut into segments
    equal = torch.full((3, 20_000), 0.5)
    ids = check(equal, 64, variant, 2)[1]
    assert variant == "torch" or ids.tolist() == [list(range(64))] * 3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cols", [5000, 40_000])  # 40,000: the kernel's pass over block maxima runs
def test_fewer_finite_values_than_k(variant, cols):
    x = torch.full((4, cols), -INF)
    x[0, [4999, 7, 300]] = torch.tensor([1.0, 2.0, 1.0])
    x[1, 100:110] = 0.0
    x[2, 2500] = INF
    x[3, :] = -torch.randn(cols, generator=torch.Generator().manual_seed(4)).abs() - 1.0
    x[3, ::2] = -INF
    x[3, [1, 3]] = torch.tensor([-0.0, 0.0])                # equal values: the lower index first
    for k in (1, 40, 256):
        values, ids = check(x, k, variant)
        if variant != "torch":
            assert ids[0, :3].tolist() == [7, 300, 4999][:k]
            assert ids[0, 3:].tolist() == [i for i in range(k - 2) if i != 7]  # -inf: lowest indices first
            assert ids[2, :1].tolist() == [2500] and ids[2, 1:].tolist() == list(range(k - 1))
            assert ids[3, :2].tolist() == [1, 3][:k]


@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_rows_fall_back_to_torch(variant):
    x = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5))
    x[1, 2999] = NAN                                         # in the scalar tail
    x[3, 5] = NAN                                            # among the first k
    x[4, 1000] = NAN                                         # in the vector scan
    for k in (1, 40):
        values, ids = run(x, k, variant)
        expected = torch.topk(x, k, dim=-1, sorted=True)
        torch.testing.assert_close(values, expected.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ids, expected.indices)
    long = torch.randn(3, 40_003, generator=torch.Generator().manual_seed(6))
    long[0, 20_000] = NAN                                    # seen by the pass over block maxima
    long[1, 40_002] = NAN                                    # in the tail that pass leaves out
    for threads in (1, 2):
        assert torch.equal(run(long, 40, variant, threads)[1], torch.topk(long, 40).indices)
    big = torch.randn(1, 200_000, generator=torch.Generator().manual_seed(6))
    big[0, 150_000] = NAN                                    # in the second segment only
    assert torch.equal(run(big, 40, variant, 2)[1], torch.topk(big, 40).indices)


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_and_other_inputs(variant):
    base = torch.randn(6, 3000, generator=torch.Generator().manual_seed(7))
    check(base[::2, :2057], 40, variant)                     # rows further apart than their length
    check(base[:, 1000:], 64, variant)                       # rows start off a vector boundary
    check(base.t().contiguous().t(), 40, variant)            # not unit inner stride: torch's path
    check(base.to(torch.float64), 40, variant)               # not float32: torch's path
    check(base, MAX_K + 1, variant)                          # above the kernel's limit: torch's path
    check(base, 3000, variant)                               # k == cols
    check(base[:0], 40, variant)                             # no rows


def test_the_kernel_is_asked_only_within_its_limit(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "_module", types.SimpleNamespace(topk_rows_f32=lambda *args: calls.append(args) or 0))
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(8))
    assert torch.equal(topk_rows(x, MAX_K + 1)[0], topk_rows_reference(x, MAX_K + 1)[0])
    assert topk_rows(x, 0)[0].shape == (2, 0)
    assert not calls
    topk_rows(x, MAX_K)
    topk_rows(x[:, :5], 5)
    assert [args[4] for args in calls] == [MAX_K, 5]
