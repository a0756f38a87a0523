"""Speculative decoding with a draft model (`speculative="draft:MODEL"`), on tiny random models with
GGUF weights on the native kernels: every request gets exactly the tokens (logprobs, finish reasons)
it gets without speculation, alone, batched, with parallel samples, seeded sampling, preemption and
context shift; the target as its own draft is always right; the draft's own KV cache gives every
block back (finish, preemption, abort); a draft with another vocabulary is refused."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest

from engine_helpers import TEST_BLOCK_SIZE, make_engine
from test_speculative import GREEDY, ids, repetitive, run
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.engine.config import ConfigError
from tokenmill.engine.speculative import SpecConfig, SpecConfigError
from tokenmill.engine.speculative.draft import DraftProposer
from tokenmill.kernels import variant
from tokenmill.model import load_model
from tokenmill.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    target = write_tiny_llama(d / "target.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, context_length=512))
    # Another model with the same vocabulary: one layer, other weights (its guesses are often wrong).
    small = write_tiny_llama(d / "small.gguf", TinyLlamaSpec(n_layers=1, weight_type=Q.Q8_0, context_length=512,
                                                             seed=7))
    gemma = write_tiny_gemma3(d / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=Q.Q8_0))
    return {"target": target, "small": small, "gemma": gemma}


@pytest.fixture(scope="module")
def target(paths):
    return load_model(paths["target"])


@pytest.fixture(scope="module")
def small(paths):
    return load_model(paths["small"])


def engine(target, draft=None, **cfg):
    """Speculation off without a draft; with one, proposals whenever allowed (rows and draft steps cost
    next to nothing here: the tests exercise verification and the draft's cache, not the policy)."""
    cfg = {"max_total_tokens": 4096, "num_speculative_tokens": 5, **cfg}
    if draft is None:
        return make_engine(target, speculative="off", **cfg)
    e = _draft_engine(target, draft, **cfg)
    spec = e.scheduler.speculator
    spec.cfg = replace(spec.cfg, row_cost=1e-4, learn_step_costs=False)
    spec.proposer.cfg = spec.cfg
    spec.proposer.draft_cost = 0.0
    return e


def _draft_engine(target, draft, **cfg):
    """make_engine's, with the draft handed in (speculative="draft:..." names it for the log only)."""
    cfg.setdefault("block_size", TEST_BLOCK_SIZE)
    return LLMEngine(target, Tokenizer.from_gguf_metadata(target.gguf.metadata),
                     EngineConfig(speculative="draft:test", **cfg), draft=draft)


def draft_blocks_used(e) -> int:
    proposer = e.scheduler.speculator.proposer
    assert isinstance(proposer, DraftProposer)
    proposer.draft.blocks.check_integrity()
    return proposer.draft.blocks.num_used_blocks


def same_with_and_without(target, draft, requests, **cfg):
    off = run(engine(target, **cfg), requests)
    e = engine(target, draft, **cfg)
    on = run(e, requests)
    assert on == off
    assert e.stats.spec.num_drafts > 0
    assert draft_blocks_used(e) == 0
    return on, e


def test_greedy_alone_and_batched_is_the_targets_own(target, small):
    requests = [(repetitive(i), GREEDY) for i in range(3)] + [(ids(40, 50 + i), GREEDY) for i in range(2)]
    requests.append((ids(30, 60), replace(GREEDY, speculative=False)))
    same_with_and_without(target, small, requests[:1])
    out, e = same_with_and_without(target, small, requests)
    assert all(len(v["ids"]) == 60 for v in out.values())
    spec = e.stats.spec
    assert spec.num_draft_tokens >= spec.num_accepted_tokens


def test_a_steps_sequences_draft_in_one_batch(target, small):
    # Four sequences decoding together: each step's draft tokens come from one batched draft forward
    # per proposal position (the catch-up rows of all four, then one row each), not one per sequence,
    # and the proposals are what each sequence drafted alone would be (the native kernels' rows do not
    # depend on the batch), so the output is the target's own.
    requests = [(repetitive(30 + i), replace(GREEDY, max_tokens=40)) for i in range(4)]
    _, e = same_with_and_without(target, small, requests)
    draft = e.scheduler.speculator.proposer.draft
    spec = e.stats.spec
    # One forward per position, five positions a step at most (num_speculative_tokens); one sequence
    # at a time would have taken one per position per sequence.
    assert draft.num_forwards < spec.num_draft_tokens / 2

    from tokenmill.engine.speculative.draft import DraftRequest
    contexts = [repetitive(40 + i)[:30 + 7 * i] for i in range(3)]
    batched = draft.generate_many([DraftRequest(100 + i, 0, c, 4) for i, c in enumerate(contexts)])
    for i, c in enumerate(contexts):
        draft.release(100 + i)
        assert draft.generate(200 + i, 0, c, 4) == batched[100 + i] and len(batched[100 + i]) == 4
        draft.release(200 + i)
    assert draft.blocks.num_used_blocks == 0
    # a long catch-up (more than n_ubatch tokens: run in pieces) and a short one in the same call
    draft.n_ubatch = 64
    long_ctx = repetitive(50, period=40, times=4)
    both = draft.generate_many([DraftRequest(300, 0, long_ctx, 3), DraftRequest(301, 0, contexts[0], 3)])
    draft.release(300), draft.release(301)
    assert both[300] == draft.generate(302, 0, long_ctx, 3) and both[301] == batched[100][:3]
    draft.release(302)


def test_the_target_as_its_own_draft_is_always_right(target):
    requests = [(ids(30, 70 + i), replace(GREEDY, max_tokens=40)) for i in range(2)]
    _, e = same_with_and_without(target, target, requests)
    spec = e.stats.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert e.stats.num_steps < 40  # several tokens a step for each sequence


def test_stop_tokens_logprobs_and_parallel_samples(target, small):
    stop = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[ids(40, 80)[5]], logprobs=True,
                          top_logprobs=2)
    requests = [(ids(40, 80), stop), (repetitive(3), replace(GREEDY, max_tokens=30, min_tokens=5))]
    same_with_and_without(target, target, requests)
    sampled = [(repetitive(13), SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True))]
    off = run(engine(target), sampled, n=3)
    e = engine(target, small)
    assert run(e, sampled, n=3) == off and len(off) == 3
    assert draft_blocks_used(e) == 0


def test_preemption_and_context_shift(target, small):
    requests = [(repetitive(20 + i, period=10, times=3), replace(GREEDY, max_tokens=50)) for i in range(6)]
    _, e = same_with_and_without(target, small, requests, max_total_tokens=10 * 16, n_batch=48)
    assert e.stats.num_preemptions > 0
    params = replace(GREEDY, max_tokens=120)
    e_off, e_on = engine(target, max_model_len=64), engine(target, target, max_model_len=64)
    off = run(e_off, [(repetitive(41, period=6, times=4), params)], shift=True, num_keep=4)
    on = run(e_on, [(repetitive(41, period=6, times=4), params)], shift=True, num_keep=4)
    assert on == off and len(on[0, 0]["ids"]) == 120
    assert e_on.stats.spec.num_accepted_tokens > 0 and draft_blocks_used(e_on) == 0


def test_an_aborted_request_gives_the_drafts_blocks_back(target):
    e = engine(target, target)
    rid = e.add_request(ids(40, 90), replace(GREEDY, max_tokens=200))
    for _ in range(4):
        e.step()
    assert draft_blocks_used(e) > 0
    e.abort(rid)
    while e.has_unfinished():
        e.step()
    assert draft_blocks_used(e) == 0 and e.blocks.num_used_blocks == 0


def test_a_full_draft_cache_means_no_proposals_not_errors(target, small):
    e = engine(target, small)
    proposer = e.scheduler.speculator.proposer
    hog = 10_000
    proposer.draft.blocks.allocate(hog, proposer.draft.blocks.num_free_blocks * proposer.draft.kv.block_size)
    off = run(engine(target), [(repetitive(5), GREEDY)])
    assert run(e, [(repetitive(5), GREEDY)]) == off
    assert e.stats.spec.num_drafts == 0
    proposer.draft.release(hog)
    assert draft_blocks_used(e) == 0


def test_the_engine_loads_a_draft_by_path_and_refuses_another_vocabulary(paths, target):
    e = LLMEngine.from_path(paths["target"], EngineConfig(speculative=f"draft:{paths['small']}", block_size=16))
    assert isinstance(e.scheduler.speculator.proposer, DraftProposer)
    off = LLMEngine.from_path(paths["target"], EngineConfig(speculative="off", block_size=16))
    assert run(e, [(repetitive(7), GREEDY)]) == run(off, [(repetitive(7), GREEDY)])
    with pytest.raises(ConfigError, match="vocabulary"):
        LLMEngine.from_path(paths["target"], EngineConfig(speculative=f"draft:{paths['gemma']}"))
    with pytest.raises(ConfigError, match="draft model"):
        LLMEngine.from_path(paths["target"], EngineConfig(speculative="draft:no-such-model"))


def test_the_setting_is_off_ngram_or_draft_with_a_model():
    from tokenmill.config import ConfigError as ServeConfigError, load_config

    assert SpecConfig.parse_method("draft:smollm2") == ("draft", "smollm2")
    assert EngineConfig(speculative="draft:smollm2").spec_config().draft_model == "smollm2"
    for bad in ("draft", "draft:", "draft: ", "medusa"):
        with pytest.raises(ConfigError, match="speculative"):
            EngineConfig(speculative=bad).validate()
        with pytest.raises(ServeConfigError, match="speculative"):
            load_config(env={"TOKENMILL_SPECULATIVE": bad})
    assert load_config(env={"TOKENMILL_SPECULATIVE": "draft:smollm2"}).engine_config().speculative == "draft:smollm2"
    with pytest.raises(SpecConfigError):
        SpecConfig(method="draft").validate()
    with pytest.raises(SpecConfigError):
        SpecConfig(method="ngram", draft_model="x").validate()


def test_a_draft_needs_the_native_path(paths, small):
    # fp32 weights run in torch, where a step's rows are not computed independently: no speculation there,
    # so a draft setting is refused rather than silently ignored.
    with pytest.raises(ConfigError, match="native kernels"):
        LLMEngine.from_path(paths["target"], EngineConfig(speculative=f"draft:{paths['small']}", dtype="fp32"))


def test_a_drafts_own_cost_makes_it_propose_less():
    from tokenmill.engine.speculative.policy import best_num_tokens

    # draft_cost 0 is prompt lookup's free proposals (the default: the n-gram path is unchanged).
    assert best_num_tokens(0.9, 1, 0.27, 8) == best_num_tokens(0.9, 1, 0.27, 8, draft_cost=0.0) > 0
    ks = [best_num_tokens(0.9, 1, 0.27, 8, draft_cost=c) for c in (0.0, 0.05, 0.2, 1.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[2]
    assert ks[-1] == 0  # a draft as costly as the target never pays


@pytest.mark.real_model
def test_smollm2_drafting_for_itself_is_always_right(smollm2_path, gemma3_path):
    # The only installed model with SmolLM2's vocabulary is SmolLM2: as its own draft it costs a whole
    # step per proposal (the policy then proposes nothing), so its cost is set as a 20x smaller draft's.
    cfg = dict(block_size=16, max_total_tokens=4096)
    off = LLMEngine.from_path(smollm2_path, EngineConfig(speculative="off", **cfg))
    on = LLMEngine.from_path(smollm2_path, EngineConfig(speculative=f"draft:{smollm2_path}", **cfg))
    proposer = on.scheduler.speculator.proposer
    assert proposer.draft_cost == pytest.approx(1.0)
    proposer.draft_cost = 0.05
    tok = off.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}]),
                        add_special_tokens=False)
    params = replace(GREEDY, max_tokens=64)
    assert run(on, [(prompt, params)]) == run(off, [(prompt, params)])
    spec = on.stats.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert on.stats.num_steps < off.stats.num_steps and draft_blocks_used(on) == 0
    with pytest.raises(ConfigError, match="vocabulary"):
        LLMEngine.from_path(smollm2_path, EngineConfig(speculative=f"draft:{gemma3_path}", **cfg))


def test_a_failing_draft_means_no_proposals_not_errors(target, small, monkeypatch):
    e = engine(target, small)
    proposer = e.scheduler.speculator.proposer
    calls = []

    def broken(ids, positions, meta, kv):
        calls.append(len(ids))
        raise RuntimeError("draft broke")

    monkeypatch.setattr(proposer.draft, "model", broken)
    requests = [(repetitive(5), GREEDY), (ids(30, 61), GREEDY)]
    assert run(e, requests) == run(engine(target), requests)
    assert calls and proposer.num_failures == len(calls) and e.stats.spec.num_drafts == 0
    assert draft_blocks_used(e) == 0


def test_a_draft_counts_in_the_engines_memory(paths, target, small):
    from tokenmill.engine.memory import engine_bytes

    alone, with_draft = engine(target), _draft_engine(target, small, max_total_tokens=4096)
    draft = with_draft.scheduler.speculator.proposer.draft
    assert draft.kv.nbytes > 0 and draft.weight_bytes == paths["small"].stat().st_size
    assert engine_bytes(with_draft) == engine_bytes(alone) + draft.weight_bytes + draft.kv.nbytes
