import math
from collections import Counter

import pytest
import torch

from tokenmill.engine.sampler import (
    Sampler,
    SamplerInput,
    apply_penalties,
    greedy_tokens,
    make_generator,
)
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.truncation import truncate_logits

sampler = Sampler()


def logits_from_probs(probs, order=None) -> torch.Tensor:
    """One row whose softmax is `probs`, optionally permuted so the best token is not id 0."""
    x = torch.log(torch.tensor(probs, dtype=torch.float32))
    if order is not None:
        x = x[torch.tensor(order)]
    return x.unsqueeze(0)


def kept(logits: torch.Tensor, **kw) -> set[int]:
    out = truncate_logits(logits, [SamplingParams(**kw)])
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


def run(logits, params, **kw) -> list[int]:
    return sampler(logits, SamplerInput(params=params, **kw)).token_ids


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    assert run(logits, [SamplingParams(temperature=0)] * 6) == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_and_nan_as_argmax_does():
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (64, 4097), generator=g).float()  # every row has many tied maxima
    logits[3, 17] = logits[3, 900] = float("nan")
    logits[5] = float("-inf")
    logits[5, 4096] = logits[5, 4000] = 0.0
    tokens = greedy_tokens(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[3] == 17 and tokens[5] == 4000
    assert all(t == int((row == row.max()).nonzero()[0]) for t, row in zip(tokens[6:], logits[6:]))


def test_bf16_logits_give_the_float32_answers():
    """The model hands over logits in its own dtype; widening them is exact, so a bf16 model
    samples exactly as if its logits were float32."""
    torch.manual_seed(7)
    x = (torch.randn(5, 300) * 4).bfloat16()
    x[0, 17] = x[0, 99] = x[0].max() + 1  # a tie: both paths pick the first
    eos = frozenset({int(x[1].argmax())})
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, ignore_eos=True),
              SamplingParams(temperature=0, repeat_penalty=1.3), SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0.7, seed=3)]
    recent = [[], [], [int(x[2].argmax())], [], []]
    for rows in ([0], [0, 1], list(range(5))):
        ps = [params[i] for i in rows]
        inp = lambda: SamplerInput(params=ps, recent_token_ids=[recent[i] for i in rows],
                                   generators=[make_generator(p.seed) for p in ps], stop_token_ids=[eos] * len(rows))
        low = sampler(x[rows].clone(), inp(), owned=True)
        wide = sampler(x[rows].float(), inp(), owned=True)
        assert low.token_ids == wide.token_ids
        assert low.logprobs == wide.logprobs
    assert low.token_ids[0] == 17 and low.token_ids[1] != next(iter(eos))


def test_greedy_batch_consumes_no_randomness():
    logits = torch.randn(4, 50)
    state = torch.get_rng_state()
    run(logits, [SamplingParams(temperature=0)] * 4)
    assert torch.equal(state, torch.get_rng_state())


def test_top_k_1_is_greedy_even_at_high_temperature():
    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    assert run(logits, [SamplingParams(temperature=5.0, top_k=1)] * 5) == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    torch.manual_seed(2)
    logits = torch.randn(4, 32)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    out = run(logits, params)
    assert out[0] == logits[0].argmax().item()
    assert out[2] == logits[2].argmax().item()
    assert out[3] in logits[3].topk(3).indices.tolist()


# ---------------------------------------------------------------- truncation masks

PROBS = [0.5, 0.3, 0.15, 0.05]
ORDER = [2, 0, 3, 1]  # vocab id v holds PROBS[ORDER[v]]: best token is id 1, then 3, 0, 2
IDS_BY_RANK = [1, 3, 0, 2]


def ranked(*ranks) -> set[int]:
    return {IDS_BY_RANK[r] for r in ranks}


def test_top_k_mask():
    x = logits_from_probs(PROBS, ORDER)
    assert kept(x, temperature=1.0, top_k=2) == ranked(0, 1)
    assert kept(x, temperature=1.0, top_k=3) == ranked(0, 1, 2)
    assert kept(x, temperature=1.0, top_k=100) == ranked(0, 1, 2, 3)


@pytest.mark.parametrize(
    "top_p, expect", [(0.45, (0,)), (0.75, (0, 1)), (0.85, (0, 1, 2)), (0.99, (0, 1, 2, 3)), (0.0, (0,))]
)
def test_top_p_mask(top_p, expect):
    x = logits_from_probs(PROBS, ORDER)
    assert kept(x, temperature=1.0, top_p=top_p) == ranked(*expect)


@pytest.mark.parametrize(
    "min_p, expect", [(0.05, (0, 1, 2, 3)), (0.25, (0, 1, 2)), (0.5, (0, 1)), (0.9, (0,))]
)
def test_min_p_mask(min_p, expect):
    x = logits_from_probs(PROBS, ORDER)
    assert kept(x, temperature=1.0, min_p=min_p) == ranked(*expect)


def typical_reference(probs: list[float], p: float) -> set[int]:
    """llama.cpp's typical sampler, written out plainly."""
    h = -sum(q * math.log(q) for q in probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - h))
    out, cum = set(), 0.0
    for i in order:
        out.add(i)
        cum += probs[i]
        if cum > p:
            break
    return out


@pytest.mark.parametrize("typical_p", [0.2, 0.4, 0.6, 0.95])
def test_typical_p_mask(typical_p):
    probs = [0.4, 0.3, 0.2, 0.1]
    expect = typical_reference(probs, typical_p)
    assert kept(logits_from_probs(probs), temperature=1.0, typical_p=typical_p) == expect
    if typical_p == 0.4:
        assert expect == {1, 2}  # typical sampling drops the single most likely token here


def test_temperature_applies_before_top_p():
    x = logits_from_probs(PROBS)
    # At T=1 the top two hold 0.8 < 0.9; at T=0.5 they hold ~0.93.
    assert kept(x, temperature=1.0, top_p=0.9) == {0, 1, 2}
    assert kept(x, temperature=0.5, top_p=0.9) == {0, 1}


def test_top_p_renormalises_after_top_k():
    x = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # Alone, top_p=0.5 needs two tokens; after top_k=2 the best one holds 0.4/0.7 > 0.5.
    assert kept(x, temperature=1.0, top_p=0.5) == {0, 1}
    assert kept(x, temperature=1.0, top_k=2, top_p=0.5) == {0}


def test_rows_keep_their_own_filters_in_one_batch():
    x = logits_from_probs(PROBS, ORDER).repeat(4, 1)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.85),
        SamplingParams(min_p=0.5),
        SamplingParams(),
    ]
    out = truncate_logits(x, params)
    sets = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in out]
    assert sets == [ranked(0, 1), ranked(0, 1, 2), ranked(0, 1), ranked(0, 1, 2, 3)]


def reference_truncate(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The chain written out one filter at a time over a full float64 sort."""
    x = row.double() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    order = x.argsort(descending=True, stable=True)
    if p.top_k:
        keep[order[p.top_k :]] = False
    if p.typical_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
        alive = keep.nonzero().flatten().tolist()
        drop = set(alive) - typical_reference_ids(probs, alive, p.typical_p)
        keep[list(drop)] = False
    if p.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)[order]
        before = probs.cumsum(0) - probs  # float64: mass of the better survivors
        keep[order[(before >= p.top_p) & (before > 0)]] = False
    if p.min_p > 0:
        keep &= x >= x.masked_fill(~keep, -math.inf).max() + math.log(p.min_p)
    return set(keep.nonzero().flatten().tolist())


def typical_reference_ids(probs: torch.Tensor, alive: list[int], p: float) -> set[int]:
    sub = [probs[i].item() for i in alive]
    return {alive[j] for j in typical_reference(sub, p)}


@pytest.mark.parametrize("scale", [8.0, 1.5, 0.05])  # nucleus within 1024, within 8192, wider
def test_wide_vocab_rows_match_reference(scale):
    torch.manual_seed(11)
    vocab = 10_000
    params = [
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.001),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8),
        SamplingParams(temperature=1.0, typical_p=0.7),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=3000, typical_p=0.9, top_p=0.95),
    ]
    x = torch.randn(len(params), vocab) * scale
    out = truncate_logits(x, params)
    for r, p in enumerate(params):
        got = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert got == reference_truncate(x[r], p), p
        # Each row gets the same answer on its own as inside the mixed batch.
        assert torch.equal(truncate_logits(x[r : r + 1], [p])[0], out[r])


def draws(x: torch.Tensor, n: int, **kw) -> Counter:
    torch.manual_seed(1234)
    return Counter(run(x.repeat(n, 1), [SamplingParams(**kw)] * n))


def test_sampled_support_and_frequencies():
    x = logits_from_probs(PROBS, ORDER)
    n = 4000
    c = draws(x, n, temperature=1.0, top_p=0.75)
    assert set(c) == ranked(0, 1)
    assert abs(c[IDS_BY_RANK[0]] / n - 0.5 / 0.8) < 0.04
    c = draws(x, n, temperature=1.0)
    for rank, p in enumerate(PROBS):
        assert abs(c[IDS_BY_RANK[rank]] / n - p) < 0.03
    assert set(draws(x, n, temperature=1.0, top_k=3)) == ranked(0, 1, 2)
    assert set(draws(x, n, temperature=1.0, min_p=0.5)) == ranked(0, 1)
    assert set(draws(logits_from_probs([0.4, 0.3, 0.2, 0.1]), n, temperature=1.0, typical_p=0.4)) == {1, 2}


# ---------------------------------------------------------------- penalties


def test_repeat_penalty_matches_llama_cpp():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    p = SamplingParams(repeat_penalty=1.5)
    out = apply_penalties(x, [p], [[0, 1, 1, 4]])
    # seen & positive: divided; seen & <= 0: multiplied; unseen: untouched
    assert out[0].tolist() == pytest.approx([2.0 / 1.5, -1.5, 0.5, 3.0, 0.0])
    assert x[0, 0] == 2.0  # input not modified


def test_a_vanishing_repeat_penalty_keeps_logits_finite():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    out = apply_penalties(x, [SamplingParams(repeat_penalty=5e-324)], [[0, 1, 3]])
    assert torch.isfinite(out).all()
    assert out[0, 0] > out[0, 2] and out[0, 3] > out[0, 2]  # seen positives pushed up, as any penalty < 1 does


def test_presence_and_frequency_penalties():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    out = apply_penalties(x, [p], [[2, 2, 2, 0]])
    assert out[0].tolist() == pytest.approx([1.0 - 0.5 - 0.25, 1.0, 1.0 - 1.5 - 0.25, 1.0])


def test_all_penalties_combined():
    x = torch.tensor([[4.0, -2.0]])
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.1, frequency_penalty=0.2)
    out = apply_penalties(x, [p], [[0, 0, 1]])
    assert out[0].tolist() == pytest.approx([4.0 / 2 - 0.4 - 0.1, -2.0 * 2 - 0.2 - 0.1])


def test_penalty_window():
    x = torch.ones(1, 4)
    hist = [[0, 1, 2]]
    last2 = apply_penalties(x, [SamplingParams(presence_penalty=1.0, repeat_last_n=2)], hist)
    assert last2[0].tolist() == [1.0, 0.0, 0.0, 1.0]
    whole = apply_penalties(x, [SamplingParams(presence_penalty=1.0, repeat_last_n=-1)], hist)
    assert whole[0].tolist() == [0.0, 0.0, 0.0, 1.0]
    off = apply_penalties(x, [SamplingParams(presence_penalty=1.0, repeat_last_n=0)], hist)
    assert off is x


def test_penalties_skipped_when_nobody_uses_them():
    x = torch.randn(3, 10)
    assert apply_penalties(x, [SamplingParams()] * 3, [[1, 2], [3], []]) is x


def test_penalties_only_touch_their_rows():
    x = torch.ones(3, 4)
    params = [SamplingParams(), SamplingParams(repeat_penalty=2.0), SamplingParams()]
    out = apply_penalties(x, params, [[0], [0, 3], [1]])
    assert out.tolist() == [[1, 1, 1, 1], [0.5, 1, 1, 0.5], [1, 1, 1, 1]]


def test_repeat_penalty_changes_greedy_choice():
    x = torch.tensor([[3.0, 2.0, 0.0]])
    assert run(x, [SamplingParams(temperature=0, repeat_penalty=2.0)], recent_token_ids=[[0]]) == [1]


# ---------------------------------------------------------------- min_tokens / ignore_eos

EOS = 3


def test_min_tokens_suppresses_eos_and_stop_ids():
    x = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]])  # EOS=3 best, then user stop id 4
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    eos = [frozenset({EOS})]
    assert run(x, [p], num_output_tokens=[0], stop_token_ids=eos) == [2]
    assert run(x, [p], num_output_tokens=[1], stop_token_ids=eos) == [2]
    assert run(x, [p], num_output_tokens=[2], stop_token_ids=eos) == [EOS]


def test_ignore_eos_always_suppresses_eos_only():
    x = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]])
    p = SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=[4])
    assert run(x, [p], num_output_tokens=[100], stop_token_ids=[frozenset({EOS})]) == [4]


def test_suppression_is_per_row():
    x = torch.tensor([[0.0, 9.0, 1.0]]).repeat(2, 1)
    params = [SamplingParams(temperature=0, min_tokens=5), SamplingParams(temperature=0)]
    assert run(x, params, num_output_tokens=[0, 0], stop_token_ids=[frozenset({1})] * 2) == [2, 1]


def test_suppressed_tokens_never_sampled():
    x = torch.zeros(2000, 4)
    p = SamplingParams(temperature=1.0, min_tokens=1)
    out = run(x, [p] * 2000, num_output_tokens=[0] * 2000, stop_token_ids=[frozenset({0, 2})] * 2000)
    assert set(out) == {1, 3}


# ---------------------------------------------------------------- seeded determinism


def seeded_run(row: int, batch: list[SamplingParams], logits: torch.Tensor, steps: int, seed: int):
    gens = [make_generator(p.seed) for p in batch]
    gens[row] = make_generator(seed)
    out = []
    for _ in range(steps):
        res = sampler(logits, SamplerInput(params=batch, generators=gens))
        out.append(res.token_ids[row])
    return out


@pytest.mark.parametrize(
    "mine",
    [
        SamplingParams(temperature=0.9, seed=42),
        SamplingParams(temperature=1.3, top_p=0.95, seed=42),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=42),
        SamplingParams(temperature=1.0, typical_p=0.9, seed=42),
    ],
)
@pytest.mark.parametrize("vocab", [300, 3000])
def test_seed_gives_same_tokens_alone_and_in_a_batch(mine, vocab):
    torch.manual_seed(7)
    steps = 12
    alone_logits = torch.randn(1, vocab) * 2
    alone = seeded_run(0, [mine], alone_logits, steps, seed=42)
    assert len(set(alone)) > 1  # really sampling, not stuck on one token

    others = [
        SamplingParams(temperature=0.5, top_k=40),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, typical_p=0.5, seed=99),
        SamplingParams(temperature=1.0, top_k=200),
    ]
    for row in (0, 5):
        batch = others[:row] + [mine] + others[row:]
        logits = torch.randn(8, vocab)
        logits[row] = alone_logits[0]
        torch.manual_seed(row)  # the shared RNG state must not matter either
        assert seeded_run(row, batch, logits, steps, seed=42) == alone


def test_different_seeds_differ():
    torch.manual_seed(0)
    x = torch.randn(1, 500)
    p = SamplingParams(temperature=1.0)
    assert seeded_run(0, [p], x, 10, seed=1) != seeded_run(0, [p], x, 10, seed=2)


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(-1), make_generator(2**64 - 1)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


# ---------------------------------------------------------------- logprobs


def test_logprobs_and_top_logprobs():
    torch.manual_seed(5)
    x = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.8, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=True, repeat_penalty=1.5),
    ]
    res = sampler(x, SamplerInput(params=params, recent_token_ids=[[], [], [int(x[2].argmax())]]))
    ref = torch.log_softmax(x, dim=-1)
    t0 = res.token_ids[0]
    assert res.logprobs[0] == pytest.approx(ref[0, t0].item(), abs=1e-5)
    assert res.logprobs[1] is None
    # Row 2 reports the penalised distribution, not the raw one.
    pen = torch.log_softmax(apply_penalties(x[2:], [params[2]], [[int(x[2].argmax())]]), dim=-1)
    assert res.logprobs[2] == pytest.approx(pen[0, res.token_ids[2]].item(), abs=1e-5)

    top = res.top_logprobs[0]
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert [i for i, _ in top] == ref[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(ref[0].topk(5).values.tolist(), abs=1e-5)
    assert res.top_logprobs[1] == [] and res.top_logprobs[2] == []


def test_no_logprobs_requested():
    res = sampler(torch.randn(2, 10), SamplerInput(params=[SamplingParams()] * 2))
    assert res.logprobs is None and res.top_logprobs is None


def test_suppressed_eos_is_left_out_of_the_top_list():
    # At -inf it is no alternative, and the APIs' JSON could not carry it.
    x = torch.tensor([[0.0, 5.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=1, top_logprobs=3)
    res = sampler(x, SamplerInput(params=[p], num_output_tokens=[0], stop_token_ids=[frozenset({1})]))
    assert res.token_ids == [2]
    assert [t for t, _ in res.top_logprobs[0]] == [2, 0]


def test_row_count_mismatch():
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 4), SamplerInput(params=[SamplingParams()]))


def test_empty_batch():
    assert sampler(torch.zeros(0, 4), SamplerInput(params=[])).token_ids == []


@pytest.mark.parametrize("knobs", [dict(top_k=40), dict(top_k=40, top_p=0.9), dict(typical_p=0.5), dict(top_p=0.9),
                                   dict()])
def test_a_nan_row_draws_a_token_inside_the_vocabulary(knobs):
    """A model whose weights are NaN (anyone can push such a blob) gives NaN logits: every sampling path
    still answers a token id of the vocabulary (the top_k path indexed one past its candidates: a 500)."""
    logits = torch.full((2, 100), float("nan"))
    logits[1] = torch.randn(100)
    ids = run(logits, [SamplingParams(temperature=0.8, seed=1, **knobs)] * 2)
    assert all(0 <= t < 100 for t in ids)
