"""Speculative decoding's parts on their own: the n-gram index, the acceptance rule, the seeded
generators' bookkeeping, back-off, the block manager's trim, and the settings' validation."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tokenmill.engine import EngineConfig, SamplingParams
from tokenmill.engine.config import ConfigError
from tokenmill.engine.sampling_params import InvalidSamplingParams
from tokenmill.engine.speculative import (NgramIndex, NgramProposer, SpecConfig, SpecConfigError, SpecCounters,
                                          num_accepted, row_generators, settle_generator)
from tokenmill.engine.speculative.ngram import Match, continuation
from tokenmill.engine.speculative.policy import AcceptanceRate, StepCosts, best_num_tokens, could_pay, expected_tokens
from tokenmill.engine.speculative.proposer import step_cost
from tokenmill.kvcache import BlockManager


# --- the n-gram index ---------------------------------------------------------------------------

def test_proposes_what_followed_the_suffix_earlier():
    ids = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert NgramIndex(1, 4).propose(ids, 3) == [4, 5, 6]


def test_longest_suffix_wins_over_a_later_shorter_match():
    # "2 3" occurred at the start (followed by 4) and "3" occurred later (followed by 7).
    ids = [2, 3, 4, 8, 3, 7, 0, 2, 3]
    assert NgramIndex(1, 4).propose(ids, 1) == [4]
    assert NgramIndex(1, 1).propose(ids, 1) == [7]  # unigrams only: the latest "3"


def test_latest_occurrence_of_the_same_ngram_wins():
    ids = [5, 6, 1, 9, 5, 6, 2, 9, 5, 6]
    assert NgramIndex(2, 2).propose(ids, 1) == [2]


def test_min_n_and_no_match():
    ids = [1, 2, 3, 4, 3]
    assert NgramIndex(2, 4).propose(ids, 4) == []  # "4 3" never occurred; "3" alone is too short
    assert NgramIndex(1, 4).propose(ids, 1) == [4]
    assert NgramIndex(1, 4).propose([7], 4) == []
    assert NgramIndex(1, 4).propose([], 4) == []


def test_a_match_running_into_the_end_continues_with_its_period():
    assert NgramIndex(1, 4).propose([8, 7, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert NgramIndex(2, 4).propose([0, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def _naive_find(ids: list[int], min_n: int, max_n: int) -> Match | None:
    """The definition, by brute force: the longest suffix (max_n down to min_n) found ending earlier,
    at its latest occurrence."""
    n_ids = len(ids)
    for n in range(min(max_n, n_ids - 1), min_n - 1, -1):
        for end in range(n_ids - 2, n - 2, -1):
            if ids[end - n + 1:end + 1] == ids[n_ids - n:]:
                return Match(end + 1, n)
    return None


@pytest.mark.parametrize("vocab,min_n,max_n", [(3, 1, 4), (6, 1, 8), (6, 2, 3), (40, 1, 2)])
def test_growing_index_agrees_with_the_definition_at_every_length(vocab, min_n, max_n):
    g = torch.Generator().manual_seed(vocab)
    ids = torch.randint(0, vocab, (300,), generator=g).tolist()
    grown = NgramIndex(min_n, max_n)
    for n in range(1, len(ids) + 1):
        assert grown.find(ids[:n]) == _naive_find(ids[:n], min_n, max_n)
    assert grown.num_indexed == len(ids)


def test_a_continuation_stops_at_the_separator_between_texts_looked_up_together():
    # A predicted output before the context: [prediction..., SEPARATOR, context...]; a match in the
    # prediction proposes what follows it there, up to its end, never the separator or past it.
    from tokenmill.engine.speculative.ngram import SEPARATOR

    prediction, context = [5, 6, 7, 8, 9], [1, 2, 5, 6]
    ids = prediction + [SEPARATOR] + context
    index = NgramIndex(2, 4)
    assert index.propose(ids, 8) == [7, 8, 9]
    assert NgramIndex(1, 4).propose([5, 6, SEPARATOR, 1, 6], 4) == []  # the prediction's last token: nothing after it


def test_the_speculator_looks_up_a_prediction_before_the_context():
    from tokenmill.engine.request import Sequence
    from tokenmill.engine.speculative import Speculator
    from tokenmill.engine.speculative.ngram import SEPARATOR

    spec = Speculator(SpecConfig(learn_step_costs=False))
    seq = Sequence(0, "r", [1, 2, 3], SamplingParams(max_tokens=16, temperature=0, prediction_ids=(2, 3, 40, 41, 42)), 4096)
    assert spec._lookup_ids(seq) == [2, 3, 40, 41, 42, SEPARATOR, 1, 2, 3]
    draft = spec.propose_all([seq], num_rows=1)[0]  # as many as the policy finds worth it, up to the separator
    assert draft and draft == [40, 41, 42][:len(draft)]
    spec.proposer.searches_prediction = False  # a draft model proposes from the context alone
    assert spec._lookup_ids(seq) == [1, 2, 3]


def test_find_says_how_long_the_match_is():
    index = NgramIndex(1, 4)
    ids = [1, 2, 3, 4, 9, 2, 3]
    assert index.find(ids) == Match(3, 2) and continuation(ids, index.find(ids), 2) == [4, 9]
    assert NgramIndex(3, 4).find(ids) is None


def test_longer_matches_earn_more_proposals_and_the_engine_learns_per_length():
    p = NgramProposer(SpecConfig())
    short = [7, 1, 2, 3, 8, 9, 1]  # "1" matches: a 1-token match
    long = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5]  # a 5-token match
    _, d_short = p.propose(None, short, 0, 8)
    state, d_long = p.propose(None, long, 0, 8)
    assert len(d_short) < len(d_long)
    before = p.by_length[5].value
    for _ in range(20):
        state, d = p.propose(state, long, 0, 8)
        p.observe(state, len(d), 0)
        state.backoff.cooldown = 0
    assert p.by_length[5].value < before and p.by_length[1].value == p.by_length[1].prior


def _naive_agreement(ids: list[int], start: int, limit: int) -> int:
    n = 0
    while n < limit and start - 1 - n >= 0 and ids[start - 1 - n] == ids[len(ids) - 1 - n]:
        n += 1
    return n


@pytest.mark.parametrize("vocab", [2, 3, 7])
def test_agreement_counts_how_far_back_a_match_holds(vocab):
    g = torch.Generator().manual_seed(vocab)
    ids = torch.randint(0, vocab, (200,), generator=g).tolist()
    index = NgramIndex(1, 4)
    for n in range(2, len(ids) + 1):
        match = index.find(ids[:n])
        if match is None:
            continue
        for limit in (1, 4, 16, 64):
            assert index.agreement(match, limit) == _naive_agreement(ids[:n], match.start, limit)


def test_a_copy_in_progress_proposes_what_its_record_allows_from_its_first_step():
    """Text copied for 16+ tokens is sized by how copies fare across the engine, not by the sequence's
    own record, which climbs a token a step (copies of 30+ tokens proposed 1, 2, 3, ... tokens a step)."""
    cfg = SpecConfig()
    source = list(range(100, 140))
    ids = [1, 2, 3] + source + [4, 5] + source[:20]  # copying `source` for 20 tokens so far
    p = NgramProposer(cfg)
    state, draft = p.propose(None, ids, 0, 16)
    assert state.copying and draft == source[20:20 + len(draft)]
    # The same 8-token match sized by the sequence's record and the engine's for 8-token matches:
    _, by_record = NgramProposer(dataclasses.replace(cfg, copy_tokens=64)).propose(None, ids, 0, 16)
    assert 0 < len(by_record) < len(draft)
    short = [1, 2, 3] + source + [4, 5] + source[:5]  # a 5-token match: not yet a copy
    state_short, _ = NgramProposer(cfg).propose(None, short, 0, 16)
    assert not state_short.copying
    before = p.copies.value  # copies that keep failing earn fewer proposals
    for _ in range(30):
        state, d = p.propose(state, ids, 0, 16)
        p.observe(state, len(d), 0)
        state.backoff.cooldown = 0
    assert p.copies.value < before
    _, fewer = p.propose(state, ids, 0, 16)
    assert len(fewer) < len(draft)


def test_a_shrinking_list_is_refused():
    index = NgramIndex(1, 2)
    index.propose([1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="shrank"):
        index.propose([1, 2], 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# --- acceptance and seeded generators -------------------------------------------------------------

@pytest.mark.parametrize("draft,sampled,expected", [
    ([5, 6, 7], [5, 6, 7, 8], 3),  # all accepted: the bonus token comes too
    ([5, 6, 7], [5, 9, 7, 8], 1),  # the first disagreement ends it, whatever follows
    ([5, 6, 7], [4, 6, 7, 8], 0),
    ([], [3], 0),
])
def test_num_accepted(draft, sampled, expected):
    assert num_accepted(draft, sampled) == expected


def test_row_generators_draw_what_the_request_generator_would_draw_in_turn():
    gen = torch.Generator().manual_seed(1234)
    sequential = torch.Generator().manual_seed(1234)
    expected = [torch.rand((1,), generator=sequential).item() for _ in range(4)]
    rows = row_generators(gen, 4)
    assert [torch.rand((1,), generator=g).item() for g in rows] == expected
    # gen itself was not touched; after 2 emitted tokens it continues with the third draw.
    settle_generator(gen, rows, 2)
    assert torch.rand((1,), generator=gen).item() == expected[2]


# --- back-off and counters ------------------------------------------------------------------------

def test_back_off_after_misses_then_retry_with_a_doubled_cooldown():
    # Rows nearly free: the acceptance rate never shrinks a proposal here, only the misses stop it.
    cfg = SpecConfig(max_misses=2, cooldown_steps=3, max_cooldown_steps=6, row_cost=1e-4)
    p = NgramProposer(cfg)
    ids = [1, 2, 3, 1, 2]
    state, draft = p.propose(None, ids, 0, 2)
    assert draft == [3, 1]
    p.observe(state, 2, 0)
    assert p.propose(state, ids, 0, 2)[1] == [3, 1]  # one miss: still proposing
    p.observe(state, 2, 0)
    assert [p.propose(state, ids, 0, 2)[1] for _ in range(3)] == [[], [], []]  # cooldown of 3
    assert p.propose(state, ids, 0, 2)[1] == [3, 1]  # the retry
    p.observe(state, 2, 0)  # fails at once: a cooldown of 6
    assert [p.propose(state, ids, 0, 2)[1] for _ in range(6)] == [[]] * 6
    assert p.propose(state, ids, 0, 2)[1] == [3, 1]
    p.observe(state, 2, 1)  # an accepted token forgives everything
    assert state.backoff.misses == 0 and state.backoff.next_cooldown == 3


def test_a_context_shift_rebuilds_the_index():
    p = NgramProposer(SpecConfig(ngram_min=1))
    state, _ = p.propose(None, [1, 2, 3, 1], 0, 2)
    state2, draft = p.propose(state, [9, 1], 10, 2)  # the context was rewritten
    assert state2 is not state and draft == []


def test_counters_by_position():
    c = SpecCounters()
    c.record(4, 2)
    c.record(2, 2)
    c.record(4, 0)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 10, 4)
    assert c.accepted_per_position == [2, 2, 0, 0]


# --- how many tokens pay for their rows ----------------------------------------------------------

def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 4) == 5


def test_best_num_tokens_grows_with_acceptance_and_shrinks_with_the_batch():
    alone = [best_num_tokens(a, 1, 0.3, 8) for a in (0.1, 0.3, 0.6, 0.8, 0.95)]
    assert alone[0] == 0 and alone == sorted(alone) and alone[-1] >= 5
    assert best_num_tokens(0.6, 1, 0.3, 8) == 2
    assert best_num_tokens(0.95, 1, 0.3, 3) == 3  # capped
    batched = [best_num_tokens(0.8, r, 0.3, 8) for r in (1, 2, 4, 8, 16)]
    assert batched == sorted(batched, reverse=True) and batched[-1] == 0
    assert best_num_tokens(0.99, 4, 1e-6, 8) == 8  # free rows: always the most


def test_acceptance_rate_follows_recent_verifications_and_drifts_back_when_idle():
    rate = AcceptanceRate(prior=0.6)
    assert rate.value == 0.6
    for _ in range(10):
        rate.observe(4, 4)
    assert rate.value > 0.9
    for _ in range(10):
        rate.observe(4, 0)
    assert rate.value < 0.4  # a miss is one failed trial, a full acceptance four successes
    low = rate.value
    for _ in range(100):
        rate.idle()
    assert low < rate.value and abs(rate.value - 0.6) < 0.01


@pytest.mark.parametrize("max_misses,most_rows_per_step", [(2, 0.05), (100, 0.3)])
def test_proposals_that_always_fail_become_rare_but_never_stop_for_good(max_misses, most_rows_per_step):
    # 2 (the default): cooldowns after misses; 100: the acceptance rate alone keeps the cost down.
    p = NgramProposer(SpecConfig(max_misses=max_misses))
    ids = [1, 2, 3, 4, 5] * 4
    state, proposed_rows = None, []
    for _ in range(400):
        state, draft = p.propose(state, ids, 0, 4)
        if draft:
            p.observe(state, len(draft), 0)
        proposed_rows.append(len(draft))
    assert proposed_rows[0] > 0  # the priors let a new sequence try
    late = proposed_rows[100:]
    assert 0 < sum(late) < most_rows_per_step * len(late)  # still retrying, rarely


# --- the block manager's trim ---------------------------------------------------------------------

def test_trim_releases_tail_blocks_and_rolls_back():
    bm = BlockManager(8, 4)
    bm.allocate(1, 13)  # 4 blocks
    table = bm.block_table(1)
    cp = bm.checkpoint()
    bm.trim(1, 6)  # 2 blocks hold 6 tokens
    assert bm.block_table(1) == table[:2] and bm.num_free_blocks == 6
    bm.check_integrity()
    bm.rollback(cp)
    assert bm.block_table(1) == table and bm.num_free_blocks == 4
    bm.check_integrity()
    bm.trim(1, 100)  # never grows
    bm.trim(99, 0)  # unknown: nothing
    assert bm.block_table(1) == table
    bm.free(1)
    assert bm.num_free_blocks == 8


def test_trim_keeps_committed_blocks_and_drops_keys_of_trimmed_ones():
    bm = BlockManager(8, 4)
    ids = list(range(12))
    bm.allocate(1, 12)
    bm.commit_full_blocks(1, ids, 12)
    bm.trim(1, 5)
    assert len(bm.state_snapshot().seq_hashes[1]) == 2
    bm.check_integrity()
    assert bm.match_prefix(ids + [0]).num_tokens == 12  # the released full block stays cached
    bm.free(1)


# --- settings -------------------------------------------------------------------------------------

def test_settings_are_validated():
    EngineConfig(speculative="off").validate()
    for bad in (dict(speculative="draft"), dict(num_speculative_tokens=0), dict(num_speculative_tokens=17),
                dict(spec_ngram_min=3, spec_ngram_max=2), dict(spec_ngram_min=0)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad).validate()
    for bad in (dict(max_misses=0), dict(row_cost=0), dict(prior_acceptance=1.0)):
        with pytest.raises(SpecConfigError):
            SpecConfig(**bad).validate()
    SamplingParams(speculative=False, num_speculative_tokens=0).validate()
    for bad in (dict(speculative="yes"), dict(num_speculative_tokens=-1), dict(num_speculative_tokens=99)):
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**bad).validate()


def test_serve_settings_reach_the_engine():
    from tokenmill.config import ConfigError as ServeConfigError, load_config

    cfg = load_config(env={"TOKENMILL_SPECULATIVE": "off", "TOKENMILL_NUM_SPECULATIVE_TOKENS": "6",
                           "TOKENMILL_SPEC_NGRAM_MIN": "1", "TOKENMILL_SPEC_NGRAM_MAX": "3"})
    ec = cfg.engine_config()
    assert (ec.speculative, ec.num_speculative_tokens, ec.spec_ngram_min, ec.spec_ngram_max) == ("off", 6, 1, 3)
    assert load_config(env={}).engine_config().spec_config() == EngineConfig().spec_config()
    with pytest.raises(ServeConfigError, match="spec_ngram_min"):
        load_config(env={"TOKENMILL_SPEC_NGRAM_MIN": "4", "TOKENMILL_SPEC_NGRAM_MAX": "2"})
    # A maximum below the default minimum (2): unigram lookups, the minimum following the maximum.
    unigrams = load_config(env={"TOKENMILL_SPEC_NGRAM_MAX": "1"})
    assert (unigrams.spec_ngram_min, unigrams.spec_ngram_max) == (1, 1)
    assert "lowered" in unigrams.source("spec_ngram_min")
    assert unigrams.engine_config().spec_config().ngram_min == 1
    with pytest.raises(ServeConfigError, match="speculative"):
        load_config(env={"TOKENMILL_SPECULATIVE": "draft"})


def test_a_longer_context_makes_rows_dearer_and_proposals_shorter():
    p = NgramProposer(SpecConfig(num_tokens=16))
    tail = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3
    short = p.propose(None, [100 + i for i in range(200)] + tail, 0, 16)[1]
    long = p.propose(None, [100 + i % 5000 for i in range(20000)] + tail, 0, 16)[1]
    assert 0 < len(long) < len(short)


# --- learned step costs ---------------------------------------------------------------------------

def test_step_costs_learn_interpolate_and_never_fall_with_more_rows():
    costs = StepCosts(prior_row_cost=0.5, window=2, stale_steps=10)
    assert not costs.ready
    costs.record(4, 0.030, 0.001)  # nothing to measure it against yet
    assert not costs.ready and not costs.ratios
    costs.record(1, 0.010, 0.001)
    assert costs.ready and costs(1) == pytest.approx(0.011)
    costs.record(1, 0.020, 0.001)  # a neighbour's work only adds time: the least recent step counts
    assert costs.model_seconds(1) == pytest.approx(0.010)
    costs.record(4, 0.030, 0.001)  # 3 one-row steps
    assert costs.model_seconds(2) == pytest.approx(0.010 * (1 + 2 / 3))  # between 1 and 4
    assert costs.model_seconds(6) == pytest.approx(0.010 * (3 + 2 * 0.5))  # past 4: the prior's slope
    costs.record(5, 0.012, 0.001)  # taken at a quieter moment: still not cheaper than 4 rows
    assert costs.model_seconds(5) == pytest.approx(0.030)
    costs.record(300, 1.0, 0.0)  # a long prefill chunk is not remembered
    assert 300 not in costs.seconds


def test_step_costs_never_price_more_rows_below_one():
    # A 2-row step seen faster than the least recent one-row step (a quieter moment, a shorter
    # context): no step of more rows is priced below a one-row step, and none falls as rows are added.
    costs = StepCosts(prior_row_cost=0.27, window=2, stale_steps=10)
    costs.record(1, 0.010, 0.0)
    costs.record(2, 0.006, 0.0)
    prices = [costs.model_seconds(r) for r in range(1, 40)]
    assert prices[0] == pytest.approx(0.010) and min(prices) == pytest.approx(0.010)
    assert all(a <= b for a, b in zip(prices, prices[1:]))
    assert costs.model_seconds(10) == pytest.approx(0.010 * (0.6 + 8 * 0.27))  # past 2: the prior's slope


def test_step_costs_follow_the_machine_and_forget_a_slow_moment():
    costs = StepCosts(prior_row_cost=0.5, window=2, stale_steps=10)
    costs.record(1, 0.010, 0.0)
    costs.record(2, 0.040, 0.0)  # one step slowed down by other work: 2 rows look like 4 one-row steps
    assert costs.model_seconds(3) >= 0.040
    costs.record(2, 0.013, 0.0)  # the next 2-row step: the slow one no longer counts
    assert costs.model_seconds(2) == pytest.approx(0.013)
    # Rows are priced in one-row steps of the moment: the machine running twice as fast halves them.
    for _ in range(2):
        costs.record(1, 0.005, 0.0)
    assert costs.model_seconds(2) == pytest.approx(0.0065)
    # A row count not seen for stale_steps steps is forgotten (priced by the prior again), so a slow
    # moment cannot keep a step size away for good.
    costs.record(3, 0.050, 0.0)
    assert costs.model_seconds(3) == pytest.approx(0.050)
    for _ in range(9):
        costs.record(1, 0.005, 0.0)
    assert 3 in costs.seconds and 2 not in costs.seconds
    costs.record(1, 0.005, 0.0)
    assert 3 not in costs.seconds and costs.model_seconds(3) == pytest.approx(0.005 * 2)


def test_learned_costs_size_proposals_alone_and_the_prior_in_a_batch():
    cfg = SpecConfig()
    costs = StepCosts(cfg.row_cost)
    assert step_cost(cfg, costs, 300, 1) == pytest.approx(cfg.row_cost * (1 + 300 / cfg.row_cost_context))
    for rows, ms in ((1, 9.3), (2, 10.9), (3, 14.3), (6, 20.1), (9, 25.3)):
        costs.record(rows, ms / 1e3, 0.0002)
    assert step_cost(cfg, costs, 300, 1) is costs and step_cost(cfg, costs, 300, cfg.learned_cost_rows) is costs
    assert isinstance(step_cost(cfg, costs, 300, 16), float)
    # Rows three at a time (as measured): a well-accepted sequence proposes 8 where the linear prior
    # picks fewer, and a weak one still proposes 1 (a second row costs little) rather than 2 or 3.
    assert best_num_tokens(0.9, 1, costs, 8) == 8 > best_num_tokens(0.9, 1, 0.3, 8)
    assert best_num_tokens(0.5, 1, costs, 8) == 1
    assert best_num_tokens(0.05, 1, costs, 8) == 0


def test_the_engine_learns_what_its_steps_cost(tmp_path):
    import gguf
    from engine_helpers import make_engine
    from tiny_model import TinyLlamaSpec, write_tiny_llama
    from tokenmill.kernels import variant
    from tokenmill.model import load_model

    if variant() == "torch":
        pytest.skip("native kernels not built")
    loaded = load_model(write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0)))
    e = make_engine(loaded, max_total_tokens=1024)
    e.add_request(list(range(3, 40)) * 2, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    costs = e.scheduler.speculator.proposer.costs
    assert costs.ready and costs.fixed >= 0 and all(s > 0 for s in costs.seconds.values())


def test_no_lookup_where_no_match_could_pay():
    # Under the prior cost model a proposal pays only if alpha > r c / (1 + c r): in a large batch no
    # acceptance the engine has seen gets there, so the sequence skips the lookup (its index catches
    # up later); in a small one it looks up and proposes as before.
    assert could_pay(0.5, 1, 0.27) and not could_pay(0.9, 64, 0.27) and could_pay(0.99, 64, 0.27)
    p = NgramProposer(SpecConfig(learn_step_costs=False))
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3
    state, draft = p.propose(None, ids, 0, 8, num_rows=64)
    assert draft == [] and state.index.num_indexed == 0
    state, draft = p.propose(state, ids + [1], 0, 8, num_rows=1)
    assert draft[:3] == [2, 3, 4] and state.index.num_indexed == len(ids) + 1
    # the skipped lookup changed nothing: an index that followed every step proposes the same
    assert NgramProposer(SpecConfig(learn_step_costs=False)).propose(None, ids + [1], 0, 8)[1] == draft


def test_a_step_where_no_sequence_could_pay_asks_none_of_them():
    # The gate is could_pay at the best acceptance among the step's sequences and the cheapest row (an
    # empty context): in a large batch under the prior no sequence is asked, so none looks up, counts a
    # cooldown step or decays; one sequence whose record could pay is enough to ask them all.
    from tokenmill.engine.speculative import Speculator
    from tokenmill.engine.request import Sequence

    cfg = SpecConfig(learn_step_costs=False)
    spec = Speculator(cfg)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3
    seqs = [Sequence(i, f"r{i}", list(ids), SamplingParams(max_tokens=64, temperature=0), 4096) for i in range(16)]
    drafts = spec.propose_all(seqs, num_rows=1)  # alone, the prior pays: each proposes the period's next tokens
    assert set(drafts) == set(range(16)) and all(d and d == ids[:len(d)] for d in drafts.values())
    state = seqs[0].spec
    rate_before, indexed = state.rate.value, state.index.num_indexed
    state.backoff.cooldown = 3
    assert not spec.proposer.any_could_pay([s.spec for s in seqs], 16)
    assert spec.propose_all(seqs, num_rows=16) == {}
    assert (state.rate.value, state.index.num_indexed, state.backoff.cooldown) == (rate_before, indexed, 3)
    # a sequence that accepted all it proposed lately could pay even in this batch: all are asked again
    state.backoff.cooldown = 0
    for _ in range(12):
        spec.observe(seqs[1], 8, 8)
    assert spec.proposer.any_could_pay([s.spec for s in seqs], 16)
    drafts = spec.propose_all(seqs, num_rows=16)
    assert set(drafts) == {s.seq_id for s in seqs} and state.backoff.cooldown == 0
    # with no sequences, and for a new sequence (no state yet) alone, the prior decides
    assert spec.propose_all([], 1) == {}
    assert spec.proposer.any_could_pay([None], 1) and not spec.proposer.any_could_pay([None], 64)


def test_step_costs_priced_between_records_match_a_fresh_pricing():
    # The multiples are kept across one-row steps and worked out again only when they can change (a step
    # of more rows, a row count forgotten): a model asked between every record prices each step as one
    # fed the same steps and asked only at the end. Random histories over the staleness window.
    rng = random.Random(7)
    for _ in range(200):
        history, asked = [], StepCosts(prior_row_cost=0.27, window=3, stale_steps=rng.choice([4, 8, 64]))
        for _ in range(rng.randrange(1, 120)):
            rows = 1 if rng.random() < 0.7 else rng.randrange(2, 12)
            seen = (rows, 0.003 * (1 + 0.3 * (rows - 1)) * rng.uniform(0.8, 2.0), rng.uniform(0, 1e-4))
            history.append(seen)
            asked.record(*seen)
            if asked.ready and rng.random() < 0.5:
                asked.span(1, rng.randrange(1, 20))
        fresh = StepCosts(prior_row_cost=0.27, window=3, stale_steps=asked.stale_steps)
        for seen in history:
            fresh.record(*seen)
        if fresh.ready:
            assert asked.span(1, 30) == fresh.span(1, 30) == [fresh(n) for n in range(1, 31)]
