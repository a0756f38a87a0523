"""The draw among each row's top_k candidates (kernels.categorical.sample_top_k, csrc/topk_draw.cpp) on
every variant this CPU runs, against its torch reference. The kernel sums in float64 where the reference
adds its top_p probabilities in float32 (the module's docstring says so): a draw must be one a float64
computation allows with every decision within rounding of its boundary taken both ways; and a token
the reference gives no weight is never drawn."""
from __future__ import annotations

import pytest
import torch

from draw_checks import sorted_draws_allowed
from tokenmill.kernels import native
from tokenmill.kernels.categorical import sample_top_k, sample_top_k_reference
from tokenmill.kernels.topk import topk_rows_reference

VARIANTS = [*native.runnable_variants(), "torch"]
INF = float("inf")


def draw(variant, *args, threads: int = 2) -> torch.Tensor:
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            return sample_top_k(*args)
    finally:
        native.set_num_threads(torch.get_num_threads())


def case(rows: int, vocab: int, K: int, seed: int, scale: float = 4.0):
    """(values, ids, k, temperature, top_p, log_min_p, uniforms): random logits' K best, k in [1, K]."""
    gen = torch.Generator().manual_seed(seed)
    values, ids = topk_rows_reference(torch.randn(rows, vocab, generator=gen) * scale, K)
    k = torch.randint(1, K + 1, (rows,), generator=gen)
    k[0] = K
    temperature = torch.rand(rows, generator=gen) * 2 + 0.05
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen))
    top_p[-1] = 0.0 if rows > 1 else top_p[-1]
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.3)
    return values, ids, k, temperature, top_p, torch.log(min_p), torch.rand(rows, generator=gen)


def allowed_draws(values, ids, k, temperature, top_p, log_min_p, uniforms) -> list[set[int]]:
    """Per row, the ids a correct draw may give (draw_checks.sorted_draws_allowed over its k candidates)."""
    return [sorted_draws_allowed(values[r, : int(k[r])].float() / temperature[r], ids[r, : int(k[r])],
                                 float(top_p[r]), float(log_min_p[r]), float(uniforms[r]))
            for r in range(values.shape[0])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,vocab,K,scale", [(64, 49152, 40, 4.0), (7, 3000, 1024, 1.0), (5, 1000, 40, 8.0),
                                                (3, 50, 50, 0.5), (2, 10, 1, 1.0), (1, 100, 40, 2.0)])
@pytest.mark.parametrize("threads", [1, 3])
def test_draws_are_among_what_the_truncation_keeps(variant, rows, vocab, K, scale, threads):
    args = case(rows, vocab, K, seed=rows + vocab + K + threads, scale=scale)
    got = draw(variant, *args, threads=threads)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    allowed = allowed_draws(*args)
    for r, token in enumerate(got.tolist()):
        assert token in allowed[r], (r, token, sorted(allowed[r])[:10])
    expected = sample_top_k_reference(*args)
    assert int((got != expected).sum()) <= max(1, rows // 16)  # boundary cases are rare, not the rule


@pytest.mark.parametrize("variant", VARIANTS)
def test_uniforms_on_a_grid_give_the_renormalised_probabilities(variant):
    # Six tokens; top_k = 4 keeps 0.4, 0.2, 0.1, 0.1 of 0.8 total: 1/2, 1/4, 1/8, 1/8 each.
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.06, 0.04])
    n = 4096
    values, ids = topk_rows_reference(probs.log().repeat(n, 1), 6)
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    ones = torch.ones(n)
    got = draw(variant, values, ids, torch.full((n,), 4), ones, ones, torch.full((n,), -INF), uniforms)
    counts = torch.bincount(got, minlength=6)
    assert torch.allclose(counts.double(), torch.tensor([0.5, 0.25, 0.125, 0.125, 0, 0]).double() * n, atol=1), counts


@pytest.mark.parametrize("variant", VARIANTS)
def test_top_p_and_min_p_at_the_extremes(variant):
    values, ids = topk_rows_reference(torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 4)), 4)  # ids 1, 3, 2, 0
    k, ones, no_min_p = torch.full((4,), 4), torch.ones(4), torch.full((4,), -INF)
    top_p = torch.tensor([0.0, 0.5, 0.79, 0.999])  # nuclei of 1, 1 (0.5 reaches 0.5), 2 and 4 tokens
    for u in (0.0, 0.45, 0.7, 0.99):
        got = draw(variant, values, ids, k, ones, top_p, no_min_p, torch.full((4,), u)).tolist()
        assert got[0] == 1 and got[1] == 1
        assert got[2] == (1 if u * 0.8 < 0.5 else 3)
        assert got[3] == (1 if u < 0.5 else 3 if u < 0.8 else 2 if u < 0.95 else 0)
    # min_p = 0.5 keeps only what has at least half the top's probability: 0.5 and 0.3
    got = draw(variant, values, ids, k, ones, ones, torch.log(torch.full((4,), 0.5)), torch.full((4,), 0.99))
    assert got.tolist() == [3] * 4
    # k = 1 is the top candidate whatever the temperature
    got = draw(variant, values, ids, torch.ones(4, dtype=torch.int64), ones * 50, ones, no_min_p, torch.full((4,), 0.99))
    assert got.tolist() == [1] * 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_removed_candidates_are_never_drawn_and_bad_rows_take_the_reference(variant):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    logits[0, 3:] = -INF  # fewer tokens left than k (a grammar mask): the -inf candidates get no weight
    values, ids = topk_rows_reference(logits, 10)
    values[1, 4] = float("nan")
    values[2] = -INF  # nothing to draw
    args = (torch.full((4,), 10), torch.ones(4), torch.full((4,), 0.9), torch.full((4,), -INF))
    for u in (0.0, 0.5, 1.0 - 2.0**-24):
        uniforms = torch.full((4,), u)
        got = draw(variant, values, ids, *args, uniforms)
        assert got[0].item() in ids[0, :3].tolist()
        for r in (1, 2):  # what the reference gives them
            assert got[r].item() == sample_top_k_reference(values[r:r + 1], ids[r:r + 1], *(a[r:r + 1] for a in args),
                                                           uniforms[r:r + 1]).item()
        assert got[3].item() in allowed_draws(values[3:], ids[3:], *(a[3:] for a in args), uniforms[3:])[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_draws_the_same_alone_in_a_batch_and_at_any_thread_count(variant):
    args = case(200, 5000, 40, seed=11)
    batch = draw(variant, *args)
    for r in (0, 99, 199):
        assert draw(variant, *(a[r:r + 1] for a in args)).item() == batch[r].item()
    for threads in (1, 3):
        assert torch.equal(draw(variant, *args, threads=threads), batch)
