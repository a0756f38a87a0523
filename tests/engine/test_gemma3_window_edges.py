"""Gemma 3's sliding window at its edges, everything on at once: a window of 5 keys in blocks of 4
tokens, so chunks, blocks, shared prefixes, proposals and their rollback, preemption and context shift
all cross the window's edge. Each request's greedy tokens (and prompt logprobs) are those it gets
alone, with speculation and the prefix cache off and its prompt in one step."""
from __future__ import annotations

import random
from dataclasses import replace

import gguf
import pytest

from engine_helpers import assert_all_free, make_engine
from tiny_model import TinyGemma3Spec, write_tiny_gemma3
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import SamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

CONTEXT = 64
BLOCK = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    spec = TinyGemma3Spec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=CONTEXT, sliding_window=5)
    return load_model(write_tiny_gemma3(tmp_path_factory.mktemp("edges") / "g.gguf", tiny_spm_metadata(), spec))


def engine(loaded, speculative: bool, **cfg):
    e = make_engine(loaded, block_size=BLOCK, max_model_len=CONTEXT, speculative="ngram" if speculative else "off",
                    num_speculative_tokens=6, spec_ngram_min=1, **cfg)
    if speculative:  # propose at every match: the tests exercise verification, not the policy
        spec = e.scheduler.speculator
        spec.cfg = spec.proposer.cfg = replace(spec.cfg, row_cost=1e-4, learn_step_costs=False)
    return e


def run(e, requests, *, every: int = 0, n: int = 1, **options) -> dict:
    """Outputs by (request, sample); `every` > 0 adds one request every that many steps, so later
    ones find the earlier ones' blocks in the prefix cache."""
    pending, rids, out, step = list(enumerate(requests)), {}, {}, 0
    while pending or e.has_unfinished():
        if pending and (not every or step % every == 0):
            take, pending = (pending, []) if not every else (pending[:1], pending[1:])
            rids |= {e.add_request(p, params, n=n, **options): i for i, (p, params) in take}
        for ev in e.step():
            rec = out.setdefault((rids[ev.request_id], ev.index), {"ids": [], "prompt": None})
            rec["ids"] += ev.token_ids
            rec["prompt"] = ev.prompt_logprobs if ev.prompt_logprobs is not None else rec["prompt"]
        e.blocks.check_integrity()
        step += 1
    assert_all_free(e)
    return out


def requests(seed: int, count: int = 5) -> list:
    """Prompts sharing prefixes of every length, repetitive ones (proposals), some asking for prompt
    logprobs; short enough to fit the context with their answers unless the context shifts."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 270) for _ in range(40)]
    out = []
    for i in range(count):
        if i % 2:
            period = rng.randrange(2, 7)
            prompt = [rng.randrange(3, 270) for _ in range(period)] * rng.randrange(3, 7)
        else:
            prompt = base[:rng.randrange(3, 40)] + [rng.randrange(3, 270) for _ in range(rng.randrange(1, 6))]
        out.append((prompt[:40], SamplingParams(max_tokens=rng.randrange(8, 24), temperature=0, ignore_eos=True,
                                                prompt_logprobs=1 if i == 2 else None)))
    return out


def first_samples_only_score_the_prompt(out: dict) -> dict:
    return {k: v if k[1] == 0 else {**v, "prompt": None} for k, v in out.items()}


@pytest.mark.parametrize("seed, cfg, every, n", [
    (1, dict(n_batch=3), 0, 1),                                  # chunks of 3 across the window
    (2, dict(n_batch=7, n_ubatch=3), 3, 2),                      # micro-batches, cached prefixes, forks
    (3, dict(n_batch=9, max_total_tokens=12 * BLOCK), 0, 1),     # preemption by recompute
    (4, dict(n_batch=16, kv_dtype="int8"), 10, 3),
    (5, dict(n_batch=5, kv_dtype="bf16", max_total_tokens=20 * BLOCK), 3, 2),
])
def test_with_everything_on_as_alone_with_everything_off(gemma, seed, cfg, every, n):
    reqs = requests(seed)
    kv = {"kv_dtype": cfg["kv_dtype"]} if "kv_dtype" in cfg else {}
    expected = {}
    for i, r in enumerate(reqs):
        got = run(engine(gemma, False, enable_prefix_caching=False, n_batch=512, n_ubatch=512, **kv), [r])[0, 0]
        expected |= {(i, j): got if j == 0 else {**got, "prompt": None} for j in range(n)}
    e = engine(gemma, True, **cfg)
    assert first_samples_only_score_the_prompt(run(e, reqs, every=every, n=n)) == expected
    assert e.stats.spec.num_accepted_tokens > 0
    if "max_total_tokens" in cfg and seed == 3:
        assert e.stats.num_preemptions > 0


@pytest.mark.parametrize("num_keep", [0, 3])
def test_context_shift_with_proposals_and_chunks(gemma, num_keep):
    # Prompts near the context's end and answers of 60 tokens (at most the context): every request shifts.
    reqs = [(p * 2, replace(params, max_tokens=60, prompt_logprobs=None)) for p, params in requests(7, 3)]
    reqs = [(p[:CONTEXT - 4], params) for p, params in reqs]
    expected = {}
    for i, r in enumerate(reqs):
        expected[i, 0] = run(engine(gemma, False, enable_prefix_caching=False, n_batch=512, n_ubatch=512), [r],
                             shift=True, num_keep=num_keep)[0, 0]
    e = engine(gemma, True, n_batch=7, n_ubatch=3)
    assert run(e, reqs, every=4, shift=True, num_keep=num_keep) == expected
    assert all(len(v["ids"]) == 60 for v in expected.values())
