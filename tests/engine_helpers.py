"""Drive an LLMEngine synchronously in tests, asserting cache integrity after every step."""
from __future__ import annotations

import random

from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.model import LoadedModel
from tokenmill.tokenizer import Tokenizer


# The engine tests' prompts and KV budgets are sized in 16-token blocks: tiny prompts then cross many
# block boundaries (sharing, copy-on-write, preemption). The default (64) is for speed.
TEST_BLOCK_SIZE = 16


def make_engine(loaded: LoadedModel, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", TEST_BLOCK_SIZE)
    return LLMEngine(loaded, Tokenizer.from_gguf_metadata(loaded.gguf.metadata), EngineConfig(**cfg))


def run_to_completion(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], *,
                      check_every_step: bool = True) -> list[list[int]]:
    """Submit all requests at once, step until done; returns each request's output ids."""
    rids = [engine.add_request(ids, p) for ids, p in requests]
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for ev in engine.step():
            outputs[ev.request_id] += ev.token_ids
        if check_every_step:
            engine.blocks.check_integrity()
    assert_all_free(engine)
    return [outputs[r] for r in rids]


def run_one_at_a_time(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return [run_to_completion(engine, [r])[0] for r in requests]


def assert_all_free(engine: LLMEngine) -> None:
    engine.blocks.check_integrity()
    assert engine.blocks.num_used_blocks == 0, f"{engine.blocks.num_used_blocks} blocks leaked"


def step_until_done(engine: LLMEngine, *, check_every_step: bool = True) -> dict[tuple[str, int], list[int]]:
    """Step until idle; output ids per (request id, sample index), for requests added beforehand."""
    outputs: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            outputs.setdefault((ev.request_id, ev.index), []).extend(ev.token_ids)
        if check_every_step:
            engine.blocks.check_integrity()
    assert_all_free(engine)
    return outputs


def random_ids(n: int, seed: int = 0) -> list[int]:
    """n token ids from the tiny vocabulary's non-special range, reproducible by seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 270) for _ in range(n)]


def assert_greedy_alone_is_batched(loaded: LoadedModel, seed: int) -> None:
    """Six prompts of 5 to 300 tokens, 8 greedy tokens each: the same tokens run one at a time as in
    one batch (steps of 64 tokens), with the engine's defaults otherwise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(6, 260, (n,), generator=g).tolist() for n in (5, 300, 17, 64, 120, 33)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [(p, params) for p in prompts]
    alone = run_one_at_a_time(make_engine(loaded, max_total_tokens=8192), reqs)
    together = run_to_completion(make_engine(loaded, max_total_tokens=8192, n_batch=64, n_ubatch=64), reqs)
    assert together == alone
