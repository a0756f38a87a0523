#!/usr/bin/env python
"""What prompt lookup could give at best here: is `bench speculative`'s shortfall in the policy (how many
tokens to propose) or in the proposals themselves?

1. Each prompt of `tokenmill bench speculative` (bench/speculative_prompts.py) is answered greedily once,
   speculation off: with greedy decoding the answer is fixed, whatever speculation does.
2. What a step of R rows costs here: one sequence at a grounded prompt's context, R - 1 proposals forced
   each step (copies of its last token, so rejected; a verification's cost does not depend on what it
   accepts), for each R (1, 2, 3, ... --max-rows) the median of --steps steps, in the least disturbed
   of three rounds (the machine is shared).
3. The answers replayed offline through the engine's own prompt lookup (NgramIndex, its min/max n):
   at each step, the proposal the engine would look up, cut to exactly the tokens the answer accepts
   (a proposer that knew where its lookup goes wrong: the bound), or not cut (--fixed K: K tokens each
   time a lookup matches). A replayed step costs what step 2 measured for its rows; the ratio is decode
   time without speculation over time with it, per prompt, and the geometric mean per kind.
4. --any-occurrence: also the bound for a lookup that knew which earlier occurrence to follow: of every
   occurrence of the context's last 1..max_n tokens, the one whose continuation the answer accepts
   furthest, cut to that length (is the shortfall in which match is followed, or in how far it goes?).

The step costs and the two replays of 3 live in tokenmill.bench.speculative_bound, which `tokenmill
bench speculative --bound` runs beside its measurements; this script adds --fixed and --any-occurrence.

    PYTHONPATH=src .venv/bin/python bench/speculative_bound.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics

from tokenmill.bench.common import cpu_flags, cpu_model, loadavg, set_threads
from tokenmill.bench.speculative import encode_chat
from tokenmill.bench.speculative_bound import COST_PROMPT, accepted_tokens, replay, replay_policy, step_costs
from tokenmill.bench.speculative_prompts import all_prompts
from tokenmill.engine.speculative.ngram import Match, continuation
from tokenmill.store import resolve_model


def greedy_answers(engine, tokenizer, max_tokens: int) -> dict[str, tuple[str, list[int], list[int]]]:
    from tokenmill.engine import SamplingParams

    out = {}
    for name, (kind, text) in all_prompts().items():
        ids = encode_chat(tokenizer, text)
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, speculative=False))
        answer: list[int] = []
        while engine.has_unfinished():
            for ev in engine.step():
                answer += ev.token_ids
        out[name] = (kind, ids, answer)
    return out


def best_occurrence_run(context: list[int], rest: list[int], max_n: int, cap: int) -> int:
    """The most tokens of `rest` any earlier occurrence of the context's last 1..max_n tokens proposes."""
    best = 0
    for n in range(1, min(max_n, len(context) - 1) + 1):
        suffix = context[-n:]
        for end in range(n - 1, len(context) - 1):
            if context[end] == suffix[-1] and context[end - n + 1:end + 1] == suffix:
                best = max(best, accepted_tokens(continuation(context, Match(end + 1, n), cap), rest))
    return best


def replay_any_occurrence(prompt: list[int], answer: list[int], cost: dict[int, float], cfg) -> float:
    """Like replay()'s perfect length, with the best occurrence's proposal at each step."""
    cap = min(cfg.num_tokens, max(cost) - 1)
    context = prompt + answer[:1]
    i, seconds = 1, 0.0
    while i < len(answer):
        accepted = min(best_occurrence_run(context, answer[i:], cfg.ngram_max, cap), len(answer) - i - 1)
        seconds += cost[1 + accepted]
        context += answer[i:i + accepted + 1]
        i += accepted + 1
    return (len(answer) - 1) * cost[1] / seconds if seconds else 1.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-rows", type=int, default=17, help="largest step measured (1 + the engine's cap of 16)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per row count and round")
    p.add_argument("--fixed", type=int, action="append", default=[],
                   help="also replay a proposer that proposes K tokens whenever its lookup matches (repeatable)")
    p.add_argument("--any-occurrence", action="store_true",
                   help="also the perfect-length bound following the best earlier occurrence (slow: every one is tried)")
    args = p.parse_args()
    from tokenmill.engine import EngineConfig, LLMEngine

    set_threads(args.threads)
    engine = LLMEngine.from_path(str(resolve_model(args.model)), EngineConfig(max_total_tokens=32768))
    if engine.scheduler.speculator is None:
        raise SystemExit("this model does not speculate here (no native kernels): nothing to bound")
    # Costs first: on a fresh engine (after the answers' requests, steps measured ~5% slower here).
    cost = step_costs(engine, encode_chat(engine.tokenizer, all_prompts()[COST_PROMPT][1]), args.max_rows, args.steps)
    answers = greedy_answers(engine, engine.tokenizer, args.max_tokens)
    cfg = engine.scheduler.speculator.cfg
    print(f"{cpu_model()} [{cpu_flags()}], {engine.threads.count} threads, load {loadavg()}")
    print("step of R rows, ms: " + "  ".join(f"{r}: {t * 1e3:.2f}" for r, t in sorted(cost.items())))
    sides = [("the engine's", "policy"), ("perfect length", None)] + [(f"always {k}", k) for k in args.fixed]
    if args.any_occurrence:
        sides.append(("any occurrence", "any"))
    policy = replay_policy(answers, cost, cfg)
    print(f"\n{'prompt':18}{'kind':10}" + "".join(f"{name:>16}" for name, _ in sides))
    ratios: dict[str, dict[str, list[float]]] = {}
    for name, (kind, prompt, answer) in answers.items():
        row = [policy[name] if k == "policy" else replay_any_occurrence(prompt, answer, cost, cfg) if k == "any"
               else replay(prompt, answer, cost, cfg, k) for _, k in sides]
        for (side, _), r in zip(sides, row):
            ratios.setdefault(kind, {}).setdefault(side, []).append(r)
        print(f"{name:18}{kind:10}" + "".join(f"{r:15.2f}x" for r in row))
    for kind, by_side in ratios.items():
        print(f"{kind + ' (geomean)':28}" + "".join(f"{statistics.geometric_mean(by_side[s]):15.2f}x"
                                                    for s, _ in sides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
