"""Speculative decoding in the engine, on tiny random models with GGUF weights on the native kernels
(batch invariant): with proposals on, every request gets exactly the tokens (and logprobs) it gets with
them off, alone or batched with sequences that do not speculate, whatever ends it (max_tokens, a stop
token, min_tokens, the context), with parallel samples, preemption, prefix caching, context shift and
Gemma 3's sliding window; the cache stays consistent after every step and nothing leaks."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from engine_helpers import assert_all_free, make_engine
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import FinishReason, SamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

GREEDY = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
# Rows cost next to nothing here, so sequences propose whenever they find a match: the tests exercise
# verification, not the policy that would pick fewer proposals on a real machine.
EAGER = dict(num_speculative_tokens=6, spec_ngram_min=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("spec") / "t.gguf",
                            TinyLlamaSpec(weight_type=Q.Q8_0, context_length=512))
    return load_model(path)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_tiny_gemma3(tmp_path_factory.mktemp("spec") / "g.gguf", tiny_spm_metadata(),
                             TinyGemma3Spec(weight_type=Q.Q8_0, context_length=512))
    return load_model(path)


def engine(loaded, spec: bool, **cfg):
    e = make_engine(loaded, max_total_tokens=cfg.pop("max_total_tokens", 4096), speculative="ngram" if spec else "off",
                    **{**EAGER, **cfg})
    e.scheduler.speculator.cfg = replace(e.scheduler.speculator.cfg, row_cost=1e-4, learn_step_costs=False)
    e.scheduler.speculator.proposer.cfg = e.scheduler.speculator.cfg
    return e


def ids(n: int, seed: int, lo: int = 3, hi: int = 270) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def repetitive(seed: int, period: int = 12, times: int = 4) -> list[int]:
    return ids(period, seed) * times + ids(3, seed + 100)


def run(e, requests, **add) -> dict:
    """Step to the end (integrity after every step); per (request, sample): tokens, logprobs, top
    logprobs, finish reason."""
    rids = [e.add_request(p, params, **add) for p, params in requests]
    out: dict = {}
    while e.has_unfinished():
        for ev in e.step():
            rec = out.setdefault((ev.request_id, ev.index), {"ids": [], "lp": [], "top": [], "end": None})
            rec["ids"] += ev.token_ids
            rec["lp"] += ev.logprobs or []
            rec["top"] += ev.top_logprobs or []
            if ev.finished:
                rec["end"] = ev.finish_reason
        e.blocks.check_integrity()
    assert_all_free(e)
    return {(rids.index(r), i): v for (r, i), v in out.items()}


def same_with_and_without(loaded, requests, *, min_accepted: int = 1, **cfg):
    off = run(engine(loaded, False, **cfg), requests)
    on_engine = engine(loaded, True, **cfg)
    on = run(on_engine, requests)
    assert on == off
    assert on_engine.stats.spec.num_accepted_tokens >= min_accepted
    return on, on_engine


def test_greedy_alone_and_batched_with_sequences_that_do_not_speculate(llama):
    requests = [(repetitive(i), GREEDY) for i in range(4)] + [(ids(40, 50 + i), GREEDY) for i in range(2)]
    requests.append((repetitive(9), replace(GREEDY, speculative=False)))
    requests.append((repetitive(10), replace(GREEDY, num_speculative_tokens=2)))
    for r in requests[:2]:
        same_with_and_without(llama, [r])
    out, e = same_with_and_without(llama, requests, min_accepted=20)
    assert all(len(v["ids"]) == 60 for v in out.values())
    assert e.stats.num_generation_tokens == 60 * len(requests)
    spec = e.stats.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_accepted_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert max(len(p) for p in [spec.accepted_per_position]) <= 6
    assert e.stats.num_steps < 60 * len(requests)  # proposals were accepted: fewer steps than tokens


def test_request_options_turn_it_on_and_off(llama):
    e = engine(llama, False)
    run(e, [(repetitive(1), GREEDY)])
    assert e.stats.spec.num_drafts == 0
    run(e, [(repetitive(1), replace(GREEDY, speculative=True))])
    assert e.stats.spec.num_drafts > 0
    e = engine(llama, True)
    run(e, [(repetitive(1), replace(GREEDY, num_speculative_tokens=0))])
    assert e.stats.spec.num_drafts == 0
    run(e, [(repetitive(1), replace(GREEDY, num_speculative_tokens=1))])
    assert e.stats.spec.num_drafts > 0 and e.stats.spec.accepted_per_position[1:] == []


def test_a_predicted_output_is_looked_up_and_changes_no_token(llama):
    # Penalties keep the tiny model's answer from repeating itself, so that prompt lookup alone finds
    # almost nothing to propose; the prediction (OpenAI's predicted outputs) is the answer itself, its
    # first half, noise, or the answer after noise: every answer is the same.
    prompt, params = ids(40, 7), replace(GREEDY, presence_penalty=2.0, repeat_penalty=1.5)
    answer = run(engine(llama, False), [(prompt, params)])[(0, 0)]["ids"]
    assert len(set(answer)) == len(answer)
    lookup = engine(llama, True, spec_ngram_min=2)
    assert run(lookup, [(prompt, params)])[(0, 0)]["ids"] == answer
    assert lookup.stats.spec.num_accepted_tokens == 0
    for prediction, least_accepted in ((answer, 45), (answer[:30], 20), (ids(60, 8), 0), (ids(9, 9) + answer, 45)):
        e = engine(llama, True, spec_ngram_min=2)
        out = run(e, [(prompt, replace(params, prediction_ids=tuple(prediction)))])
        assert out[(0, 0)]["ids"] == answer
        assert e.stats.spec.num_accepted_tokens >= least_accepted
        assert e.stats.num_steps < lookup.stats.num_steps or not least_accepted
    # speculation off for the request: the prediction is not looked up
    e = engine(llama, True)
    run(e, [(prompt, replace(params, prediction_ids=tuple(answer), speculative=False))])
    assert e.stats.spec.num_drafts == 0
    with pytest.raises(ValueError, match="prediction"):
        e.add_request(prompt, replace(params, prediction_ids=(1, 10**6)))
    with pytest.raises(ValueError, match="prediction"):
        e.add_request(prompt, replace(params, prediction_ids=[1, 2]))
    assert_all_free(e)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_ends_a_run_of_accepted_tokens(llama, max_tokens):
    out, _ = same_with_and_without(llama, [(repetitive(3, period=4, times=8), replace(GREEDY, max_tokens=max_tokens))],
                                   min_accepted=0)
    assert len(out[0, 0]["ids"]) == max_tokens and out[0, 0]["end"] is FinishReason.LENGTH


def test_a_stop_token_ends_a_run_of_accepted_tokens(llama):
    prompt = repetitive(4, period=6, times=6)
    plain = run(engine(llama, False), [(prompt, GREEDY)])[0, 0]["ids"]
    for at in (3, 7, 20):
        stop = plain[at]
        first = plain.index(stop)
        params = replace(GREEDY, ignore_eos=False, stop_token_ids=[stop])
        out, _ = same_with_and_without(llama, [(prompt, params)], min_accepted=0)
        assert out[0, 0]["ids"] == plain[:first + 1] and out[0, 0]["end"] is FinishReason.STOP
        # min_tokens suppresses the stop token on every row until enough tokens are out
        params = replace(params, min_tokens=first + 5)
        out, _ = same_with_and_without(llama, [(prompt, params)], min_accepted=0)
        assert len(out[0, 0]["ids"]) >= first + 5


def test_logprobs_of_accepted_tokens_are_those_without_speculation(llama):
    params = replace(GREEDY, logprobs=True, top_logprobs=3)
    out, _ = same_with_and_without(llama, [(repetitive(5), params), (ids(30, 6), params)], min_accepted=5)
    assert len(out[0, 0]["lp"]) == len(out[0, 0]["top"]) == 60


# Low temperatures: the random model's distributions are flat, and proposals must be accepted at times
# for the seeded generators' bookkeeping to matter. Compiled draws (plain, nucleus) and torch's (top_k,
# typical_p) both.
@pytest.mark.parametrize("knobs", [dict(temperature=0.2), dict(temperature=0.3, top_k=5),
                                   dict(temperature=0.3, top_p=0.9), dict(temperature=0.2, min_p=0.05),
                                   dict(temperature=0.2, typical_p=0.9)])
def test_seeded_samples_are_the_same_with_and_without_speculation(llama, knobs):
    params = SamplingParams(max_tokens=40, seed=11, ignore_eos=True, **knobs)
    same_with_and_without(llama, [(repetitive(6, period=5, times=8), params), (repetitive(7), params)],
                          min_accepted=1)


def test_penalties_see_the_proposals_before_each_row(llama):
    for knobs in (dict(repeat_penalty=1.3, repeat_last_n=8), dict(presence_penalty=0.5, frequency_penalty=0.3),
                  dict(repeat_penalty=1.1, repeat_last_n=-1)):
        same_with_and_without(llama, [(repetitive(8, period=5, times=8), replace(GREEDY, **knobs))], min_accepted=0)


def test_parallel_samples(llama):
    requests = [(repetitive(12), replace(GREEDY, max_tokens=40)),
                (repetitive(13), SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True))]
    off = run(engine(llama, False), requests[:1], n=3) | {(1, i): v for (_, i), v in
                                                          run(engine(llama, False), requests[1:], n=3).items()}
    e = engine(llama, True)
    on = run(e, requests[:1], n=3) | {(1, i): v for (_, i), v in run(e, requests[1:], n=3).items()}
    assert on == off and len(on) == 6
    assert e.stats.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_parallel_samples_of_a_prompt_whose_last_chunk_is_one_token(which, request):
    # Chunks of 7 leave the prompt's last token for a step of its own: one token to compute, as a
    # decode has. It must not propose then, with samples still to fork: each fork sampled from every
    # proposal row and started past the proposals (the step failed with a ValueError).
    loaded, requests = request.getfixturevalue(which), [(repetitive(14, period=4, times=8)[:29], GREEDY)]
    off = run(engine(loaded, False, n_batch=7), requests, n=2)
    on = run(engine(loaded, True, n_batch=7), requests, n=2)
    assert on == off and sorted(on) == [(0, 0), (0, 1)] and on[0, 0]["end"] == FinishReason.LENGTH


def test_preemption_by_recompute_with_prefix_caching(llama):
    requests = [(repetitive(20 + i, period=10, times=3), replace(GREEDY, max_tokens=50)) for i in range(6)]
    out, e = same_with_and_without(llama, requests, max_total_tokens=10 * 16, n_batch=48)
    assert e.stats.num_preemptions > 0


def test_the_prefix_cache_never_keeps_rejected_proposals(llama):
    # A's blocks are committed as it goes; B's prompt is A's whole context, so B adopts every full
    # block A committed. Had one held the K/V of a rejected proposal, B's output would differ.
    a = ids(60, 30, hi=20)  # few distinct tokens: many matches, many of them wrong
    e = engine(llama, True, max_total_tokens=2048)
    a_out = run(e, [(a, replace(GREEDY, max_tokens=100))])[0, 0]["ids"]
    assert e.stats.spec.num_draft_tokens > e.stats.spec.num_accepted_tokens  # some were rejected
    b = a + a_out + ids(5, 31)
    b_out = run(e, [(b, replace(GREEDY, speculative=False))])[0, 0]
    assert e.blocks.prefix_stats().hits >= (len(a) + 90) // 16 * 16
    fresh = run(engine(llama, False, enable_prefix_caching=False), [(b, GREEDY)])[0, 0]
    assert b_out == fresh


def test_context_limit_and_shift(llama):
    params = replace(GREEDY, max_tokens=120)
    same_with_and_without(llama, [(repetitive(40, period=6, times=4), params)], max_model_len=64)
    e_off, e_on = engine(llama, False, max_model_len=64), engine(llama, True, max_model_len=64)
    off = run(e_off, [(repetitive(41, period=6, times=4), params)], shift=True, num_keep=4)
    on = run(e_on, [(repetitive(41, period=6, times=4), params)], shift=True, num_keep=4)
    assert on == off and len(on[0, 0]["ids"]) == 120
    assert e_on.stats.spec.num_accepted_tokens > 0


def test_a_small_token_budget_caps_the_proposals(llama):
    requests = [(repetitive(50 + i, period=5, times=5), GREEDY) for i in range(3)]
    e = engine(llama, True, n_batch=4, n_ubatch=4)
    widest = []
    e.step_hook = lambda batch: widest.append(batch.num_tokens)
    on = run(e, requests)
    assert max(widest) <= 4
    assert on == run(engine(llama, False, n_batch=4, n_ubatch=4), requests)


def test_proposals_split_over_micro_batches(llama):
    requests = [(repetitive(60 + i, period=5, times=5), GREEDY) for i in range(5)]
    same_with_and_without(llama, requests, n_ubatch=3)


def test_gemma3_sliding_window(gemma):
    # TinyGemma3Spec's local layers see 8 tokens: proposals and rejections cross its edge all the time.
    requests = [(repetitive(70, period=30, times=7), replace(GREEDY, max_tokens=80)),
                (ids(20, 71, hi=200), replace(GREEDY, max_tokens=80))]
    same_with_and_without(gemma, requests, max_total_tokens=8192)


@pytest.mark.parametrize("pattern", [r"(ab ){12}", r"[a-c]{40}", r"(xy|xz){6}", r"(hello world, )+"])
@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_grammar_constrained_proposals(llama, pattern, temperature):
    # Proposals are cut where the grammar refuses a token or would complete, and every proposed row
    # samples under its own mask: the output is the one without speculation, and it matches.
    import re

    from tokenmill.structured import GrammarCompiler, GrammarSpec

    e = engine(llama, True)
    grammar = GrammarCompiler(e.tokenizer).compile_now(GrammarSpec("regex", pattern))
    prompt = e.tokenizer.encode("abcd ab ab xy xz hello world, hello world, " * 3)
    params = SamplingParams(max_tokens=50, temperature=temperature, seed=4, constraint=grammar)
    off = run(engine(llama, False), [(prompt, params)])
    on = run(e, [(prompt, params)])
    assert on == off
    text = e.tokenizer.decode(on[0, 0]["ids"], skip_special_tokens=True)
    assert re.fullmatch(pattern, text) or on[0, 0]["end"] is FinishReason.LENGTH
    if pattern == r"(ab ){12}":
        assert e.stats.spec.num_accepted_tokens > 5  # the grammar forces a repeating answer


def test_no_proposals_on_the_torch_path(loaded):
    # fp32 weights on torch: rows are not computed the same whatever the batch, so nobody proposes.
    assert make_engine(loaded).scheduler.speculator is None


def test_grammar_rows_cut_a_proposal_where_the_grammar_refuses_or_completes(llama):
    from tokenmill.engine.speculative import Speculator
    from tokenmill.structured import GrammarCompiler, GrammarSpec

    tok = make_engine(llama).tokenizer
    grammar = GrammarCompiler(tok).compile_now(GrammarSpec("regex", r"ab{0,3}c"))
    a, b, c, d = (tok.encode(x, add_special_tokens=False)[0] for x in "abcd")
    constraint = grammar.new_constraint()
    draft, rows = Speculator.grammar_rows(constraint, [a, b, b, d, b])
    assert draft == [a, b, b] and len(rows) == 3  # d is refused
    assert Speculator.grammar_rows(constraint, [a, b, c, a])[0] == [a, b]  # c completes: nothing may follow
    assert Speculator.grammar_rows(constraint, [b])[0] == []
    assert constraint.accept(a)  # the sequence's own state was not advanced by any of this
