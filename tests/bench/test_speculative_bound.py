"""The speculative replays on hand-made contexts (tokenmill.bench.speculative_bound, and bench/speculative_bound.py
on top): the perfect-length replay, the engine's policy replayed, and the bound that follows the best earlier
occurrence (the engine's lookup follows the latest, longest one)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from speculative_bound import best_occurrence_run, replay, replay_any_occurrence  # noqa: E402

CFG = SimpleNamespace(ngram_min=1, ngram_max=8, num_tokens=16)
COST = {rows: 1.0 + 0.25 * (rows - 1) for rows in range(1, 18)}


def test_best_occurrence_beats_the_latest_match():
    # "7" occurs twice before the end: the latest occurrence goes on 8 9, the earlier one 1 2 3 4.
    context = [7, 1, 2, 3, 4, 5, 7, 8, 9, 7]
    assert best_occurrence_run(context, [1, 2, 3, 4, 6], max_n=8, cap=16) == 4
    assert best_occurrence_run(context, [8, 9, 0], max_n=8, cap=16) == 2
    assert best_occurrence_run(context, [5, 5], max_n=8, cap=16) == 0
    assert best_occurrence_run(context, [1, 2, 3, 4], max_n=8, cap=2) == 2  # the cap holds


def test_replays_count_steps_at_their_costs():
    prompt = [7, 1, 2, 3, 4, 5, 7, 8, 9]
    answer = [7, 1, 2, 3, 4, 6, 6]  # after "7": the earlier occurrence's run of four, then new text
    latest = replay(prompt, answer, COST, CFG, None)
    best = replay_any_occurrence(prompt, answer, COST, CFG)
    # Best occurrence: one step of 5 rows makes 1 2 3 4 6 (4 accepted + the model's own), one more step
    # makes the last 6: 6 tokens after the first in cost 2 + 1 = 3 one-row steps.
    assert best == (len(answer) - 1) * COST[1] / (COST[5] + COST[1])
    assert best > latest >= 1.0


def test_bounds_replay_the_policy_and_the_perfect_length():
    from tokenmill.bench.speculative_bound import bounds
    from tokenmill.engine.speculative.config import SpecConfig

    cfg = SpecConfig()  # the engine's defaults: 2- to 8-token lookups, up to 16 proposals
    prompt = list(range(100, 160))
    answers = {"copy": ("grounded", prompt, [100, *prompt[1:40]]),           # repeats its prompt
               "fresh": ("open", prompt, list(range(200, 240)))}             # repeats nothing
    replayed = bounds(answers, COST, cfg)
    perfect, policy = replayed["copy"]
    # Linear costs: a step's fixed part paid once for all it accepts, so cutting each lookup to exactly
    # what is accepted is the best any sizing of the same lookups does; the policy proposes after the
    # first 2-token match and gains.
    assert perfect >= policy > 1.0
    assert perfect == replay(prompt, answers["copy"][2], COST, cfg, None)
    assert replayed["fresh"] == (1.0, 1.0)  # no lookup ever matches: every step is a plain one
