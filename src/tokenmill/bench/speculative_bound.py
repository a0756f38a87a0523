"""How far prompt lookup could go on this machine: what a step of R rows costs here, and greedy answers
replayed offline at those costs, with the perfect proposal length and with the engine's own policy.

A greedy answer is fixed whatever speculation does, so its steps can be replayed: at each step the
lookup the engine would make, its proposal cut to exactly the tokens the answer accepts (perfect
length: a proposer that knew where its lookup goes wrong), or sized by the engine's own proposer
(NgramProposer, its policy and learned acceptance); each replayed step costs what a step of its rows
measured here. The ratio is decode time without speculation over time with it. Perfect length is the
mark for sizing, not a strict ceiling: where a step's cost grows faster than its rows, splitting a
long accepted run over two steps can cost less, and a policy can land slightly above it.

`tokenmill bench speculative --bound` prints both beside the measured ratios; bench/speculative_bound.py
adds fixed-length proposers and the best-occurrence bound."""
from __future__ import annotations

import statistics
import time

from tokenmill.engine.speculative.ngram import NgramIndex, continuation
from tokenmill.engine.speculative.policy import StepCosts
from tokenmill.engine.speculative.proposer import NgramProposer
from tokenmill.engine.speculative.verify import num_accepted

COST_PROMPT = "extract-actions"  # a grounded prompt of typical length (~320 tokens): the context step costs are measured at
STEP_COST_STEPS = 12  # timed steps per row count and round


class ForcedProposals:
    """Stands in for the engine's proposer: every decoding sequence proposes `k` copies of its last token."""

    def __init__(self, inner):
        self.inner = inner
        self.costs = inner.costs
        self.nbytes = 0
        self.k = 0

    def any_could_pay(self, states, num_rows):
        return True

    def propose_many(self, asks, num_rows=1):
        return [(self.inner.propose(state, ids, shifted, 0, num_rows)[0], [ids[-1]] * self.k)
                for state, ids, shifted, _ in asks]

    def observe(self, *args):
        pass

    def forget(self, state):
        self.inner.forget(state)


def step_costs(engine, prompt: list[int], max_rows: int, steps: int) -> dict[int, float]:
    """Median seconds of a step of R rows (one sequence, R - 1 forced proposals), R = 1..max_rows, in the
    least disturbed of three rounds (the machine is shared). The engine's own proposer is back in place
    afterwards; its learned step costs will have seen these steps (they are this machine's)."""
    from tokenmill.engine import SamplingParams

    spec = engine.scheduler.speculator
    forced = ForcedProposals(spec.proposer)
    spec.proposer = forced
    try:
        costs: dict[int, list[float]] = {}
        for _ in range(3):  # rounds over the row counts, so a busy minute touches them all
            for rows in range(1, max_rows + 1):
                forced.k = 0
                # A step usually emits one token (copies of the last one are seldom right), but a model
                # that repeats itself accepts them: room for every proposal accepted, and no end token
                # (the greedy head takes the argmax of the other columns at the same cost).
                rid = engine.add_request(prompt, SamplingParams(max_tokens=(steps + 10) * rows + 16, temperature=0,
                                                                ignore_eos=True))
                for _ in range(8):  # a request's first decode steps run slower (~10% here)
                    engine.step()
                forced.k = rows - 1
                for _ in range(2):  # the first step of this size pays for its buffers
                    engine.step()
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
                costs.setdefault(rows, []).append(statistics.median(times))
                if not engine.has_unfinished():
                    raise RuntimeError("the sequence ended while its steps were timed")
                engine.abort(rid)
                forced.k = 0
                while engine.has_unfinished():
                    engine.step()
        return {rows: min(ts) for rows, ts in costs.items()}  # the least disturbed round's median
    finally:
        spec.proposer = forced.inner


def accepted_tokens(proposal: list[int], rest: list[int]) -> int:
    """How many leading proposals the rest of the answer agrees with (the engine's rule, verify.py)."""
    return num_accepted(proposal[:len(rest)], rest)


def replay(prompt: list[int], answer: list[int], cost: dict[int, float], cfg, fixed: int | None) -> float:
    """Decode time without speculation over the time with it, the answer's steps replayed: each lookup's
    proposal cut to what the answer accepts (fixed None: perfect length), or fixed tokens whenever it matches."""
    index = NgramIndex(cfg.ngram_min, cfg.ngram_max)
    most = max(cost)
    cap = min(cfg.num_tokens, most - 1)
    context = prompt + answer[:1]  # the first token comes with the prompt's step
    i, seconds = 1, 0.0
    while i < len(answer):
        match = index.find(context)
        proposal = continuation(context, match, cap if fixed is None else min(fixed, cap)) if match is not None else []
        accepted = accepted_tokens(proposal, answer[i:])
        rows = 1 + (len(proposal) if fixed is not None else accepted)
        seconds += cost[rows]
        emitted = min(accepted + 1, len(answer) - i)
        context += answer[i:i + emitted]
        i += emitted
    return (len(answer) - 1) * cost[1] / seconds if seconds else 1.0


def replay_policy(answers: dict[str, tuple[str, list[int], list[int]]], cost: dict[int, float], cfg,
                  proposer_cls=NgramProposer) -> dict[str, float]:
    """The engine's own proposer (its policy, back-off and learned acceptance, one proposer over all the
    prompts in turn, as in the bench), its step costs taught from `cost`: decode time without
    speculation over the time with it, per prompt. answers: name -> (kind, prompt ids, answer ids)."""
    costs = StepCosts(cfg.row_cost)
    for rows, seconds in cost.items():
        costs.record(rows, seconds, 0.0)
    proposer = proposer_cls(cfg, costs)
    cap = min(cfg.num_tokens, max(cost) - 1)
    out = {}
    for name, (_, prompt, answer) in answers.items():
        context = prompt + answer[:1]
        state, i, seconds = None, 1, 0.0
        while i < len(answer):
            state, proposal = proposer.propose(state, context, 0, min(cap, len(answer) - i - 1))
            accepted = accepted_tokens(proposal, answer[i:])
            if proposal:
                proposer.observe(state, len(proposal), accepted)
            seconds += cost[1 + len(proposal)]
            context += answer[i:i + accepted + 1]
            i += accepted + 1
        out[name] = (len(answer) - 1) * cost[1] / seconds if seconds else 1.0
    return out


def bounds(answers: dict[str, tuple[str, list[int], list[int]]], cost: dict[int, float],
           cfg) -> dict[str, tuple[float, float]]:
    """name -> (the perfect-length replay, the engine's policy replayed), each answer at these step costs."""
    policy = replay_policy(answers, cost, cfg)
    return {name: (replay(prompt, answer, cost, cfg, None), policy[name])
            for name, (_, prompt, answer) in answers.items()}
