"""Context management: prompt truncation (keep num_keep + the newest tail) and context shift during
generation (drop the older half after num_keep, recompute the rest from position 0)."""
from __future__ import annotations

import logging

import pytest

from engine_helpers import random_ids as ids, make_engine, run_to_completion, step_until_done
from tokenmill.engine import FinishReason, PromptTooLongError, SamplingParams
from tokenmill.engine.context import generation_reserve, shift_context, truncate_prompt


def test_truncate_prompt_keeps_head_and_tail():
    p = list(range(100))
    cut = truncate_prompt(p, limit=64, num_keep=5, reserve=8)
    assert cut.token_ids == p[:5] + p[49:] and len(cut.token_ids) == 56 and cut.num_dropped == 44
    assert truncate_prompt(p[:30], 64, 5, 8).token_ids == p[:30]  # fits: unchanged
    assert truncate_prompt(p, 64, 500, 8).token_ids == p[:55] + [99]  # num_keep clamped: the last token stays
    assert generation_reserve(64, 8) == 8 and generation_reserve(64, None) == 16 and generation_reserve(2, 5) == 1


def test_shift_context_drops_the_older_half_after_num_keep():
    kept, dropped = shift_context(list(range(40)), num_keep=4)
    assert dropped == 18 and kept == [0, 1, 2, 3, *range(22, 40)]
    assert shift_context([1, 2], num_keep=9) == ([2], 1)


def test_engine_truncates_when_asked_and_rejects_otherwise(loaded, caplog):
    engine = make_engine(loaded, max_total_tokens=1024)
    p = ids(100, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(PromptTooLongError):
        engine.add_request(p, params, num_ctx=64)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        rid = engine.add_request(p, params, num_ctx=64, truncate=True, num_keep=5)
    assert "truncated to 56" in caplog.text and "dropped the 44" in caplog.text
    [seq] = engine.scheduler.find(rid)
    assert seq.prompt_ids == p[:5] + p[-51:]
    out = step_until_done(engine)[rid, 0]
    assert out == run_to_completion(engine, [(p[:5] + p[-51:], params)])[0]


def test_context_shift_generates_past_num_ctx(loaded):
    engine = make_engine(loaded, max_total_tokens=1024)
    p = ids(10, seed=2)
    params = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True)
    rid = engine.add_request(p, params, num_ctx=32, num_keep=4, shift=True)
    [seq] = engine.scheduler.find(rid)
    out: list[int] = []
    reasons = []
    after_shift = None  # (kept context, output length) at the first shift
    while engine.has_unfinished():
        for ev in engine.step():
            out += ev.token_ids
            reasons.append(ev.finish_reason)
        if after_shift is None and seq.num_shifted_tokens:
            after_shift = (list(seq.all_token_ids), len(seq.output_ids))
            assert seq.all_token_ids[:4] == p[:4] and seq.num_computed_tokens <= len(seq.all_token_ids)
        assert seq.num_tokens <= 32
        engine.blocks.check_integrity()
    assert len(out) == 45 and reasons[-1] is FinishReason.LENGTH and seq.num_shifted_tokens >= 14
    assert engine.blocks.num_used_blocks == 0
    # What follows a shift is what the model says given the kept tokens as a fresh prompt.
    kept, n_out = after_shift
    fresh = run_to_completion(make_engine(loaded, max_total_tokens=1024),
                              [(kept, SamplingParams(max_tokens=32 - len(kept), temperature=0, ignore_eos=True))])[0]
    assert out[n_out:n_out + len(fresh)] == fresh


def test_without_shift_a_full_context_ends_with_length(loaded):
    engine = make_engine(loaded, max_total_tokens=1024, max_sequence_length=24)
    assert engine.max_model_len == 24
    rid = engine.add_request(ids(10, seed=3), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), n=2)
    out = step_until_done(engine)
    assert len(out[rid, 0]) == len(out[rid, 1]) == 14


def test_shift_with_parallel_samples_frees_everything(loaded):
    engine = make_engine(loaded, max_total_tokens=1024)
    rid = engine.add_request(ids(20, seed=4), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                             num_ctx=24, num_keep=2, shift=True, n=2)
    out = step_until_done(engine)
    assert out[rid, 0] == out[rid, 1] and len(out[rid, 0]) == 16


def test_the_penalty_window_is_the_contexts_tail_before_and_after_shifts(loaded):
    engine = make_engine(loaded, max_total_tokens=1024)
    rid = engine.add_request(ids(10, seed=3), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                             num_ctx=24, num_keep=4, shift=True)
    [seq] = engine.scheduler.find(rid)
    while engine.has_unfinished():
        engine.step()
        context = seq.all_token_ids
        for n in (0, 1, 5, 12, 23, 64):
            assert seq.last_token_ids(n) == (context[-n:] if n else [])
        assert seq.last_token_ids(-1) == context
    assert seq.num_shifted_tokens > 0
