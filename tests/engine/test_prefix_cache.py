"""Prefix caching across requests: a new request maps the longest cached prefix (even one a running
request is still using), to the token (a prefix that ends inside a block copies that block's K/V),
always computes its last prompt token, and counts cached vs computed."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_helpers import random_ids as ids, make_engine, run_to_completion, step_until_done
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.engine import SamplingParams
from tokenmill.kernels import native
from tokenmill.model import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_new_request_shares_blocks_of_a_running_one(loaded):
    a = ids(64, seed=0)
    b = a[:48] + ids(10, seed=1)
    expected = run_to_completion(make_engine(loaded, max_total_tokens=1024, enable_prefix_caching=False),
                                 [(a, GREEDY), (b, GREEDY)])
    engine = make_engine(loaded, max_total_tokens=1024)
    ra = engine.add_request(a, GREEDY)
    first = engine.step()  # a's prompt is computed and its full blocks committed; a keeps running
    rb = engine.add_request(b, GREEDY)
    events = engine.step()
    [seq_a], [seq_b] = engine.scheduler.find(ra), engine.scheduler.find(rb)
    assert seq_b.num_cached_prompt_tokens == 48
    assert engine.blocks.block_table(seq_b.seq_id)[:3] == engine.blocks.block_table(seq_a.seq_id)[:3]
    assert next(ev for ev in events if ev.request_id == rb).num_cached_tokens == 48
    rest = step_until_done(engine)
    assert first[0].token_ids + [t for ev in events if ev.request_id == ra for t in ev.token_ids] + rest[ra, 0] \
        == expected[0]
    assert [t for ev in events if ev.request_id == rb for t in ev.token_ids] + rest[rb, 0] == expected[1]
    assert engine.stats.num_cached_prompt_tokens == 48
    assert engine.stats.num_prompt_tokens == 64 + 10


def test_identical_prompt_still_computes_its_last_token_and_freed_blocks_stay_cached(loaded):
    p = ids(64, seed=2)  # exactly 4 full blocks
    engine = make_engine(loaded, max_total_tokens=1024)
    first = run_to_completion(engine, [(p, GREEDY)])[0]  # done: all blocks are free, still cached
    before = engine.blocks.prefix_stats()
    rid = engine.add_request(p, GREEDY)
    events = engine.step()
    assert events[0].num_cached_tokens == 63  # 3 of 4 blocks and 15 tokens of the 4th: the last is computed
    rest = step_until_done(engine)
    assert events[0].token_ids + rest[rid, 0] == first
    stats = engine.blocks.prefix_stats()
    assert (stats.hits - before.hits, stats.queries - before.queries) == (63, 64)
    assert engine.stats.num_cached_prompt_tokens == 63


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny model with Q8_0 weights in the gguf mode: its steps run in the native core (when built)."""
    path = write_tiny_llama(tmp_path_factory.mktemp("q") / "tiny-q8.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0))
    return load_model(path, "gguf")


@pytest.mark.parametrize("weights,kv_dtype", [("dense", "auto"), ("quantized", "auto"), ("quantized", "int8")])
def test_a_prefix_ending_inside_a_block_is_copied_and_continued(loaded, quantized, weights, kv_dtype):
    """A prompt sharing 40 tokens with a running one (2 blocks and 8 tokens of its 3rd), and one sharing
    a finished conversation turn to its last computed token (the turn's partly filled block, kept when
    it finished), compute only what follows and generate what a cold engine generates."""
    if kv_dtype == "int8" and native.module() is None:
        pytest.skip("an int8 cache needs the compiled core")
    model = loaded if weights == "dense" else quantized
    a = ids(50, seed=20)
    b = a[:40] + ids(9, seed=21)
    turn = ids(37, seed=22)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cold = make_engine(model, max_total_tokens=1024, enable_prefix_caching=False, kv_dtype=kv_dtype)
    engine = make_engine(model, max_total_tokens=1024, kv_dtype=kv_dtype)

    [reply] = run_to_completion(engine, [(turn, params)])  # 37 + 5 computed: its 3rd block holds 10
    follow_up = turn + reply + ids(7, seed=23)
    outputs: dict[str, list[int]] = {}

    def collect(events):
        for ev in events:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)

    ra = engine.add_request(a, params)
    collect(engine.step())  # a's prompt computed, its 3 full blocks committed; a keeps running
    rb, rc = engine.add_request(b, params), engine.add_request(follow_up, params)
    collect(engine.step())
    [seq_a], [seq_b], [seq_c] = (engine.scheduler.find(r) for r in (ra, rb, rc))
    assert seq_b.num_cached_prompt_tokens == 40
    assert seq_c.num_cached_prompt_tokens == len(turn) + len(reply) - 1  # all but the reply's last token
    table_a, table_b = engine.blocks.block_table(seq_a.seq_id), engine.blocks.block_table(seq_b.seq_id)
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]  # the 3rd block is b's own copy
    for (rid, _), tokens in step_until_done(engine).items():
        outputs.setdefault(rid, []).extend(tokens)

    expected = run_to_completion(cold, [(turn, params), (a, params), (b, params), (follow_up, params)])
    assert [reply] + [outputs[r] for r in (ra, rb, rc)] == expected


def test_preempted_requests_rematch_their_prefix_and_give_the_same_output(loaded):
    system = ids(32, seed=3)
    reqs = [(system + ids(8, seed=10 + i), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
            for i in range(6)]
    unconstrained = run_to_completion(make_engine(loaded, max_total_tokens=4096, enable_prefix_caching=False), reqs)
    engine = make_engine(loaded, max_total_tokens=12 * 16, n_batch=48)
    assert run_to_completion(engine, reqs) == unconstrained
    assert engine.stats.num_preemptions > 0
    assert engine.blocks.prefix_stats().hits > 0 and engine.stats.num_cached_prompt_tokens > 0


@pytest.mark.real_model
def test_real_model_cached_prefix_and_forked_samples_match_a_cold_run(smollm2_path):
    """SmolLM2 fp32: a prompt partly served from the cache, forked into 3 greedy samples that
    copy-on-write its partial last block, generates what a cold single request generates."""
    real = load_model(smollm2_path, torch.float32)
    tok = make_engine(real, max_total_tokens=512).tokenizer
    system = tok.encode("You are a careful assistant. Answer every question in one short sentence, plainly, "
                        "without lists, without headings and without repeating the question back. ")
    prompt = system + tok.encode("Question: what is the capital of France? Answer:")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cold_engine = make_engine(real, max_total_tokens=512, enable_prefix_caching=False)
    cold = run_to_completion(cold_engine, [(prompt, params)])[0]
    engine = make_engine(real, max_total_tokens=512)
    run_to_completion(engine, [(system + tok.encode(" Hello"), SamplingParams(max_tokens=1, temperature=0))])
    rid = engine.add_request(prompt, params, n=3)
    outputs = step_until_done(engine, check_every_step=False)
    assert [outputs[rid, i] for i in range(3)] == [cold] * 3
    assert engine.stats.num_cached_prompt_tokens >= 16 * (len(system) // 16) > 0
