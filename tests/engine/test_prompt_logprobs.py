"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine on the tiny model: each prompt
token after the first scored from the row before it, as a whole-prompt forward of the model gives
them, and the same (to the dense fp32 matmuls' rounding) whether the prompt is computed in one step
or in chunks, alone or beside other requests, after its blocks were cached by an earlier request (a
scoring request recomputes them), or again after a preemption."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_all_free, make_engine, random_ids
from model_helpers import BLOCK, new_cache
from tokenmill.engine import SamplingParams
from tokenmill.engine.sampling_params import InvalidSamplingParams
from tokenmill.model import AttentionMetadata, ChunkSpec

K = 3


@torch.inference_mode()
def whole_prompt_scores(model, ids: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each prompt token's logprob and the top k, from one forward over the whole prompt."""
    kv, table = new_cache(model.config, len(ids), model.embed.dtype)
    meta = AttentionMetadata.build([ChunkSpec(table, 0, len(ids))], BLOCK)
    logp = torch.log_softmax(model.logits(model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)).float(), dim=-1)
    return [(logp[j, ids[j + 1]].item(), list(zip(*(x.tolist() for x in reversed(logp[j].topk(k))))))
            for j in range(len(ids) - 1)]


def scores_of(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Each request's prompt scores, from its first event."""
    rids = [engine.add_request(ids, p) for ids, p in requests]
    first: dict[str, list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.prompt_logprobs is not None:
                assert ev.request_id not in first  # on the first event only
                first[ev.request_id] = ev.prompt_logprobs
    assert_all_free(engine)
    return [first.get(r) for r in rids]


def assert_same_scores(got: list, ref: list) -> None:
    # The tiny model runs dense fp32 matmuls, whose rounding may depend on the rows in a call (the
    # quantized kernels' may not: tests/engine/test_engine_real.py holds SmolLM2's bitwise).
    assert len(got) == len(ref)
    for (lp, top), (ref_lp, ref_top) in zip(got, ref):
        assert lp == pytest.approx(ref_lp, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-5)


def params(k: int | None = K, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k, **kw)


def test_scores_match_a_whole_prompt_forward(loaded):
    ids = random_ids(50, seed=1)
    (got,) = scores_of(make_engine(loaded), [(ids, params())])
    ref = whole_prompt_scores(loaded.model, ids, K)
    assert len(got) == len(ids) - 1
    for (lp, top), (ref_lp, ref_top) in zip(got, ref):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in ref_top] and len(top) == K
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)
        assert top[0][1] >= top[1][1] >= top[2][1] and lp <= top[0][1] + 1e-6


def test_chunks_batches_and_the_prefix_cache_do_not_change_them(loaded):
    ids = random_ids(70, seed=2)
    (alone,) = scores_of(make_engine(loaded), [(ids, params())])
    (chunked,) = scores_of(make_engine(loaded, n_batch=16), [(ids, params())])
    mixed = scores_of(make_engine(loaded, n_batch=48), [(random_ids(30, seed=3), params(None)), (ids, params()),
                                                        (random_ids(9, seed=4), params(0))])
    assert_same_scores(chunked, alone)
    assert_same_scores(mixed[1], alone)
    assert mixed[0] is None
    assert len(mixed[2]) == 8 and all(top == [] for _, top in mixed[2])

    engine = make_engine(loaded)
    scores_of(engine, [(ids, params(None))])  # caches the prompt's blocks
    before = engine.blocks.match_prefix(ids)
    assert before is not None and before.num_tokens > 0
    engine.add_request(ids, params())
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert events[0].num_cached_tokens == 0  # computed again, to have its logits
    assert_same_scores(events[0].prompt_logprobs, alone)


def test_preempted_prompts_keep_their_scores_in_order(loaded):
    prompts = [random_ids(100, seed=10 + i) for i in range(3)]
    alone = [scores_of(make_engine(loaded), [(p, params())])[0] for p in prompts]
    # Ten blocks of 16: the second prompt is admitted beside the first and preempted half computed.
    engine = make_engine(loaded, max_total_tokens=160, n_batch=48)
    seqs = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (seqs.append(seq), add(seq))
    together = scores_of(engine, [(p, params()) for p in prompts])
    assert any(s.num_preemptions and len(s.prompt_scores) == 99 for s in seqs)
    for got, ref in zip(together, alone):
        assert_same_scores(got, ref)


def test_every_sample_gets_them_and_a_one_token_prompt_has_none(loaded):
    engine = make_engine(loaded)
    ids = random_ids(20, seed=5)
    engine.add_request(ids, SamplingParams(max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=1), n=3)
    engine.add_request([7], params())
    got: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.prompt_logprobs is not None:
                got[ev.request_id, ev.index] = ev.prompt_logprobs
    assert_all_free(engine)
    by_len = sorted(got.values(), key=len)
    assert by_len[0] == [] and len(by_len) == 4
    assert by_len[1] == by_len[2] == by_len[3] and len(by_len[1]) == 19  # one computation, shared


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_out_of_range_values_are_refused(value):
    with pytest.raises(InvalidSamplingParams, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()


def test_the_offline_api_puts_none_first(tiny_gguf, loaded):
    from tokenmill.engine import LLM, EngineConfig

    ids = random_ids(12, seed=6)
    (out,) = LLM(tiny_gguf, EngineConfig(dtype="fp32")).generate([ids], params(2))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert_same_scores(out.prompt_logprobs[1:], whole_prompt_scores(loaded.model, ids, 2))
    (plain,) = LLM(tiny_gguf, EngineConfig(dtype="fp32")).generate([ids], params(None))
    assert plain.prompt_logprobs is None
