"""Draws from softmax(logits / temperature) with min_p (kernels.categorical) on every variant this CPU
runs, against the torch reference. The kernel's exp and float64 block sums differ from the reference's
in the last bits (its docstring says so), so a draw must be the reference's own token, or one whose
boundary lies within 1e-6 of the total from u * total; and a token the reference gives no weight is
never drawn."""
from __future__ import annotations

import pytest
import torch

from draw_checks import sorted_draws_allowed
from tokenmill.kernels import native
from tokenmill.kernels.categorical import (sample_categorical, sample_categorical_reference, sample_nucleus,
                                           sample_nucleus_reference)

VARIANTS = [*native.runnable_variants(), "torch"]
INF = float("inf")


def draw(variant: str, logits, temperature, log_min_p, uniforms, threads: int = 2) -> torch.Tensor:
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            return sample_categorical(logits, temperature, log_min_p, uniforms)
    finally:
        native.set_num_threads(torch.get_num_threads())


def reference_cdf(logits, temperature, log_min_p) -> torch.Tensor:
    v = logits.float() / temperature[:, None]
    m = v.max(dim=-1, keepdim=True).values
    v = v.masked_fill(v < m + log_min_p[:, None], -INF)
    return (v - m).exp().double().cumsum(dim=-1)


def check(got, logits, temperature, log_min_p, uniforms) -> int:
    """Every draw is within rounding of the reference's; returns how many differ from it."""
    expected = sample_categorical_reference(logits, temperature, log_min_p, uniforms)
    cdf = reference_cdf(logits, temperature, log_min_p)
    total = cdf[:, -1]
    target = uniforms.double() * total
    for r, k in enumerate(got.tolist()):
        before = cdf[r, k - 1].item() if k > 0 else 0.0
        assert cdf[r, k].item() > before, f"row {r}: drew token {k}, which has no weight"
        slack = 1e-6 * total[r].item()
        assert before - slack <= target[r].item() < cdf[r, k].item() + slack, (r, k, expected[r].item())
    return int((got != expected).sum())


def random_case(rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, cols, generator=gen) * 4
    temperature = torch.rand(rows, generator=gen) * 2 + 0.05
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.3)
    return logits, temperature, torch.log(min_p), torch.rand(rows, generator=gen)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,cols", [(64, 49152), (1, 262144), (3, 1000), (2, 7), (1, 1), (5, 64 * 7 + 13)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_draws_agree_with_the_reference(variant, rows, cols, threads):
    case = random_case(rows, cols, seed=rows * cols + threads)
    got = draw(variant, *case, threads=threads)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert check(got, *case) <= max(1, rows // 16)  # boundary cases are rare, not the rule


@pytest.mark.parametrize("variant", VARIANTS)
def test_uniforms_on_a_grid_give_the_probabilities(variant):
    # 5 tokens of known probability; uniforms (j + 0.5) / N hit each token about N * p times.
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    n = 4096
    logits = probs.log().repeat(n, 1)
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    got = draw(variant, logits, torch.ones(n), torch.full((n,), -INF), uniforms)
    counts = torch.bincount(got, minlength=5)
    assert torch.allclose(counts.double(), probs.double() * n, atol=1), counts


@pytest.mark.parametrize("variant", VARIANTS)
def test_removed_tokens_are_never_drawn(variant):
    cols = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, cols, generator=gen)
    logits[:, ::3] = -INF                                   # masked by a grammar or by suppression
    logits[0] = -INF
    logits[0, 151] = 1.0                                     # one token left: always it
    logits[1, 299] = 50.0                                    # the last token dominates, at the tail
    log_min_p = torch.log(torch.tensor([0.0, 0.0, 0.5, 0.9, 0.0, 0.1, 0.99, 0.0]))
    for u in (0.0, 0.5, 1.0 - 2.0**-24):
        uniforms = torch.full((8,), u)
        got = draw(variant, logits, torch.ones(8), log_min_p, uniforms)
        check(got, logits, torch.ones(8), log_min_p, uniforms)
        assert got[0].item() == 151
        assert got[1].item() == (299 if u > 0 else 1)  # u = 0 takes the first token with any weight
        assert all(got[r].item() % 3 != 0 for r in range(8))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_gives_the_same_draw_alone_and_in_a_batch(variant):
    logits, temperature, log_min_p, uniforms = random_case(33, 5000, seed=9)
    batch = draw(variant, logits, temperature, log_min_p, uniforms)
    alone = [draw(variant, logits[r:r + 1], temperature[r:r + 1], log_min_p[r:r + 1], uniforms[r:r + 1]).item()
             for r in (0, 17, 32)]
    assert alone == [batch[r].item() for r in (0, 17, 32)]
    for threads in (1, 3):
        assert torch.equal(draw(variant, logits, temperature, log_min_p, uniforms, threads=threads), batch)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_without_a_token_to_draw_take_the_reference(variant):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    logits[0, 7] = float("nan")
    logits[1] = -INF
    args = (torch.ones(3), torch.full((3,), -INF), torch.full((3,), 0.3))
    got = draw(variant, logits, *args)
    assert torch.equal(got[:2], sample_categorical_reference(logits[:2], *(a[:2] for a in args)))
    check(got[2:], logits[2:], *(a[2:] for a in args))


def test_strided_rows_read_their_own_values():
    wide = torch.randn(4, 700, generator=torch.Generator().manual_seed(2))
    logits = wide[:, 50:650]  # row stride 700
    args = (torch.full((4,), 0.7), torch.full((4,), -INF), torch.tensor([0.1, 0.4, 0.6, 0.9]))
    check(sample_categorical(logits, *args), logits, *args)


# --- top_p (sample_nucleus) ---------------------------------------------------------------------

def nucleus_draws_allowed(logits, temperature, top_p, log_min_p, uniforms, tol=1e-5) -> list[set[int]]:
    """Per row, the tokens a correct draw may give (draw_checks.sorted_draws_allowed over the sorted row)."""
    allowed = []
    for r in range(logits.shape[0]):
        vals, ids = (logits[r].float() / temperature[r]).sort(descending=True, stable=True)
        allowed.append(sorted_draws_allowed(vals, ids, float(top_p[r]), float(log_min_p[r]), float(uniforms[r]), tol))
    return allowed


def draw_nucleus(variant, *args, threads: int = 2):
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            return sample_nucleus(*args)
    finally:
        native.set_num_threads(torch.get_num_threads())


def nucleus_case(rows: int, cols: int, seed: int, scale: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    logits, temperature, log_min_p, uniforms = random_case(rows, cols, seed)
    logits = torch.randn(rows, cols, generator=gen) * scale
    top_p = torch.rand(rows, generator=gen)
    top_p[0] = 0.0  # only the top token
    return logits, temperature, top_p, log_min_p, uniforms


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,cols,scale", [(16, 49152, 6.0), (4, 49152, 1.0), (1, 262144, 8.0), (3, 1000, 3.0),
                                             (2, 7, 1.0), (1, 1, 1.0), (5, 64 * 7 + 13, 2.0)])
@pytest.mark.parametrize("threads", [1, 3])
def test_nucleus_draws_are_in_the_nucleus(variant, rows, cols, scale, threads):
    case = nucleus_case(rows, cols, seed=rows + cols + threads, scale=scale)
    got = draw_nucleus(variant, *case, threads=threads)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    allowed = nucleus_draws_allowed(*case)
    for r, k in enumerate(got.tolist()):
        assert k in allowed[r], (r, k, sorted(allowed[r])[:10])
    if rows > 1:
        expected = sample_nucleus_reference(*case)
        assert int((got != expected).sum()) <= max(1, rows // 4)  # the reference sums in float32


@pytest.mark.parametrize("variant", VARIANTS)
def test_nucleus_at_the_extremes(variant):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    top_p = torch.tensor([0.0, 0.5, 0.79, 0.999])  # nuclei of 1, 1 (0.5 reaches 0.5), 2 and 4 tokens
    for u in (0.0, 0.45, 0.7, 0.99):
        got = draw_nucleus(variant, logits, torch.ones(4), top_p, torch.full((4,), -INF), torch.full((4,), u))
        assert got[0].item() == 0 and got[1].item() == 0
        assert got[2].item() == (0 if u * 0.8 < 0.5 else 1)
        assert got[3].item() == (0 if u < 0.5 else 1 if u < 0.8 else 2 if u < 0.95 else 3)
    # min_p then drops the nucleus's tail: 0.15 and 0.05 are below 0.5 * 0.5
    got = draw_nucleus(variant, logits, torch.ones(4), torch.full((4,), 0.999), torch.log(torch.full((4,), 0.5)),
                       torch.full((4,), 0.99))
    assert got.tolist() == [1] * 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_nucleus_rows_alone_and_in_a_batch_and_without_a_token(variant):
    case = nucleus_case(12, 3000, seed=4)
    batch = draw_nucleus(variant, *case)
    assert [draw_nucleus(variant, *(a[r:r + 1] for a in case)).item() for r in (0, 11)] == [batch[0].item(),
                                                                                              batch[11].item()]
    assert torch.equal(draw_nucleus(variant, *case, threads=1), batch)
    logits = case[0].clone()
    logits[3, 5] = float("nan")
    logits[4] = -INF
    got = draw_nucleus(variant, logits, *case[1:])
    assert got[3].item() == sample_nucleus_reference(logits[3:4], *(a[3:4] for a in case[1:])).item()
    assert got[4].item() == sample_nucleus_reference(logits[4:5], *(a[4:5] for a in case[1:])).item()
