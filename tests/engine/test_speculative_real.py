"""Speculative decoding on the real models at their default settings (GGUF weights on the native
kernels): SmolLM2's greedy answers to prompts it copies from are the same tokens with proposals on and
off, alone and batched with requests that do not speculate, cut by max_tokens or a stop token in the
middle of an accepted run, with parallel samples, preemption and the prefix cache; the same for Gemma 3
across its sliding window; seeded sampling too. Proposals are accepted along the way (the runs take
fewer steps than tokens).

The speculating engines size their proposals with the prior cost model (no step costs learned from the
clock): a row's price learned from wall time made how much was proposed, and so the counts asserted
here, depend on the machine and its load (on the scalar kernels, where a row costs nearly a whole step,
the learned costs rightly proposed little and the counts fell short). Greedy tokens are the same
whatever is proposed; these tests check that, with proposals certainly made."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine_helpers import assert_all_free, make_engine
from tokenmill.bench.speculative_prompts import GROUNDED, OPEN_ENDED
from tokenmill.engine import FinishReason, SamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

pytestmark = [pytest.mark.real_model, pytest.mark.skipif(variant() == "torch", reason="native kernels not built")]

GREEDY = SamplingParams(max_tokens=96, temperature=0)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


def chat(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(engine, requests, **add) -> dict:
    rids = [engine.add_request(p, params, **add) for p, params in requests]
    out: dict = {}
    while engine.has_unfinished():
        for ev in engine.step():
            rec = out.setdefault((rids.index(ev.request_id), ev.index), {"ids": [], "lp": [], "end": None})
            rec["ids"] += ev.token_ids
            rec["lp"] += ev.logprobs or []
            if ev.finished:
                rec["end"] = ev.finish_reason
        engine.blocks.check_integrity()
    assert_all_free(engine)
    return out


def speculating(loaded, **cfg):
    """An engine with the default speculation, its proposals sized by the prior cost model."""
    e = make_engine(loaded, **cfg)
    spec = e.scheduler.speculator
    spec.cfg = replace(spec.cfg, learn_step_costs=False)
    spec.proposer.cfg = spec.cfg
    return e


def both(loaded, requests, **cfg):
    off = run(make_engine(loaded, speculative="off", **cfg), requests)
    on_engine = speculating(loaded, **cfg)
    on = run(on_engine, requests)
    assert on == off
    return on, on_engine


def test_grounded_prompts_alone_and_batched_with_plain_ones(smollm2):
    e = make_engine(smollm2)
    grounded = [chat(e, GROUNDED[name]) for name in ("code-typehints", "extract-people", "quote-article")]
    open_ended = [chat(e, OPEN_ENDED[name]) for name in ("story", "explain")]
    out, on = both(smollm2, [(grounded[0], GREEDY)], max_total_tokens=8192)
    assert on.stats.spec.num_accepted_tokens > 40 and on.stats.num_steps < 60
    requests = [(p, GREEDY) for p in grounded] + [(p, replace(GREEDY, speculative=False)) for p in open_ended]
    out, on = both(smollm2, requests, max_total_tokens=8192)
    assert on.stats.spec.num_accepted_tokens > 100


def test_max_tokens_and_stop_tokens_in_the_middle_of_a_run(smollm2):
    e = make_engine(smollm2)
    prompt = chat(e, GROUNDED["code-logging"])
    plain = run(make_engine(smollm2, speculative="off", max_total_tokens=4096), [(prompt, GREEDY)])[0, 0]["ids"]
    for n in (7, 30, 61):
        out, _ = both(smollm2, [(prompt, replace(GREEDY, max_tokens=n))], max_total_tokens=4096)
        assert out[0, 0]["ids"] == plain[:n] and out[0, 0]["end"] is FinishReason.LENGTH
    for at in (20, 50):
        stop = plain[at]
        out, _ = both(smollm2, [(prompt, replace(GREEDY, stop_token_ids=[stop], logprobs=True))],
                      max_total_tokens=4096)
        assert out[0, 0]["ids"] == plain[:plain.index(stop) + 1] and out[0, 0]["end"] is FinishReason.STOP


def test_parallel_samples_preemption_and_prefix_cache(smollm2):
    e = make_engine(smollm2)
    prompts = [chat(e, GROUNDED[name]) for name in ("code-rename", "code-typehints", "extract-actions")]
    # A cache of 40 blocks of 16 tokens cannot hold three ~250-token prompts and their answers at once.
    out, on = both(smollm2, [(p, replace(GREEDY, max_tokens=64)) for p in prompts], max_total_tokens=40 * 16,
                   n_batch=128)
    assert on.stats.num_preemptions > 0 and on.stats.spec.num_accepted_tokens > 0
    seeded = SamplingParams(max_tokens=48, temperature=0.3, seed=7)
    off = run(make_engine(smollm2, speculative="off", max_total_tokens=8192), [(prompts[1], seeded)], n=3)
    e_on = speculating(smollm2, max_total_tokens=8192)
    assert run(e_on, [(prompts[1], seeded)], n=3) == off
    assert e_on.stats.spec.num_accepted_tokens > 0


def test_gemma3_across_its_sliding_window(gemma3_path):
    loaded = load_model(gemma3_path)
    window = loaded.config.extra["attention.sliding_window"]
    e = make_engine(loaded, max_total_tokens=8192)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(60))
    prompt = e.tokenizer.encode(text + "\nItem 60:")
    assert len(prompt) > window  # proposals are verified by local layers that no longer see the start
    out, on = both(loaded, [(prompt, replace(GREEDY, max_tokens=120))], max_total_tokens=8192)
    assert on.stats.spec.num_accepted_tokens > 20


def test_json_schema_constrained_extraction(smollm2):
    from tokenmill.structured import GrammarCompiler, GrammarSpec

    e = make_engine(smollm2, max_total_tokens=8192)
    schema = {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "string"}},
                                               "next_meeting": {"type": "string"}},
              "required": ["people", "next_meeting"]}
    grammar = GrammarCompiler(e.tokenizer).compile_now(GrammarSpec("json_schema", schema))
    prompt = chat(e, "Extract the people present and the date of the next meeting as JSON.\n\n"
                  + GROUNDED["extract-actions"].split("\n\n", 1)[1])
    params = SamplingParams(max_tokens=96, temperature=0, constraint=grammar)
    out, on = both(smollm2, [(prompt, params)], max_total_tokens=8192)
    assert on.stats.spec.num_drafts > 0
