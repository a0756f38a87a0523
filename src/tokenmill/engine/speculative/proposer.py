"""Which tokens a decoding sequence proposes this step, and how it backs off when they keep failing.

Each sequence keeps its own SpecState (its n-gram index, its acceptance rate, its record of misses),
made on its first proposal. How many tokens it proposes follows from the expected acceptance (its own
recent record, and the engine's for matches of that length) and the step's size (policy.py), so
proposals that are seldom right shrink to none; and a sequence whose proposals are rejected outright
several times in a row stops proposing for a while (doubling while retries fail).
Either way, on text that does not repeat, a speculating sequence costs what an ordinary one does."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.speculative.config import SpecConfig
from tokenmill.engine.speculative.ngram import NgramIndex, continuation
from tokenmill.engine.speculative.policy import AcceptanceRate, StepCosts, best_num_tokens, could_pay


def _length_prior(n: int) -> float:
    """First guesses for how often an n-token match's proposals are accepted, from SmolLM2 on the
    prompts of bench/speculative_prompts.py (the first proposed token was right after 33% of 1-token
    matches in grounded answers, 12% in open-ended ones; 63% / 37% after 2-token matches; 70-96% from 3
    tokens on). Each engine learns its own from there."""
    return {1: 0.3, 2: 0.55, 3: 0.7}.get(n, 0.8)


@dataclass
class BackOff:
    """A sequence's record of proposals rejected outright, and the cooldown it earns (every proposer's)."""
    misses: int = 0          # verifications in a row that accepted nothing
    cooldown: int = 0        # steps left without proposals
    next_cooldown: int = 0   # the length of the next cooldown (doubles while retries fail)

    def cooling(self) -> bool:
        """Whether this step is one of a cooldown's (and count it)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return True
        return False

    def observe(self, cfg: SpecConfig, num_accepted: int) -> None:
        """Count a miss, or forgive them all; enough misses in a row start a cooldown."""
        if num_accepted:
            self.misses = 0
            self.next_cooldown = cfg.cooldown_steps
            return
        self.misses += 1
        if self.misses >= cfg.max_misses:
            self.misses = cfg.max_misses - 1  # one more miss after the cooldown starts another
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(2 * self.next_cooldown, cfg.max_cooldown_steps)


@dataclass
class SpecState:
    index: NgramIndex
    num_shifted_tokens: int  # the sequence's at creation: a context shift rewrites the context
    rate: AcceptanceRate
    backoff: BackOff = field(default_factory=BackOff)
    match_len: int = 0       # the length of the match behind the proposal being verified
    copying: bool = False    # whether that match was a copy in progress (SpecConfig.copy_tokens)


def row_cost(cfg: SpecConfig, context_len: int) -> float:
    """One more row's cost as a share of a step's fixed cost: a row's attention reads the whole context."""
    return cfg.row_cost * (1 + context_len / cfg.row_cost_context)


def step_cost(cfg: SpecConfig, costs: StepCosts, context_len: int, num_rows: int) -> StepCosts | float:
    """The cost model a proposal is sized with: the steps this engine has seen, or the prior row cost.
    Learned costs only size proposals for a sequence in a small step (up to learned_cost_rows rows),
    where a row more or less is most of the difference and steps of each size recur; in a batch their
    averages mix other contexts and prefill chunks, and the prior's verdict (proposals seldom pay there)
    holds: a 16-request burst went 0.98x -> 0.89x of no speculation when the learned costs sized its
    proposals too."""
    if cfg.learn_step_costs and costs.ready and num_rows <= cfg.learned_cost_rows:
        return costs
    return row_cost(cfg, context_len)


def any_could_pay(cfg: SpecConfig, costs: StepCosts, num_rows: int, *alphas: float) -> bool:
    """Whether a proposal could pay in a step of num_rows rows for a sequence whose acceptance is judged
    as the mean of alphas (each the best among the step's sequences), at the row cost of an empty
    context: an optimistic could_pay for the whole step. Where it says no, the step asks no sequence to
    propose, and nothing of theirs moves (no lookup, no cooldown step counted, no idle decay): a step
    in which proposing was never an option says nothing about proposing."""
    if step_cost(cfg, costs, 0, num_rows) is costs:  # learned costs: each sequence is priced itself
        return True
    return could_pay(sum(alphas) / len(alphas), num_rows, cfg.row_cost)


@dataclass
class SpecCounters:
    """Totals in vLLM's terms: drafts (verifications with at least one proposal), proposed tokens,
    accepted tokens, and accepted tokens by position in the draft."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    """Prompt lookup for the sequences of one engine, with per-sequence back-off."""

    def __init__(self, cfg: SpecConfig, costs: StepCosts | None = None):
        self.cfg = cfg
        self.costs = costs if costs is not None else StepCosts(cfg.row_cost)
        # How often a match of each length is right, learned over every sequence of the engine (a
        # 1-token match is a guess; an 8-token one usually a copy): index n is for n-token matches.
        self.by_length = [AcceptanceRate(prior=_length_prior(n), weight=8.0, decay=0.98, idle_decay=1.0)
                          for n in range(cfg.ngram_max + 1)]
        self._best_length_rate = max(r.value for r in self.by_length)  # kept up by observe()
        # How often a proposal is right while text is being copied (at least cfg.copy_tokens of the
        # context's last tokens agree with those before the match), learned over every sequence. A copy
        # goes on far longer than an 8-token match's record says, which mixes copies with the matches
        # where one ends: the sequences' own rates, climbing a token a step, made copies of 30+ tokens
        # propose 1, 2, 3, ... tokens a step. Replayed over `bench speculative`'s greedy answers
        # (bench/speculative_bound.py's model, steps costing 1 + c (rows - 1) one-row steps), grounded
        # prompts went 1.67x -> 1.73x of plain decoding at c = 0.27 (1.87 -> 1.96 at 0.2, 1.48 -> 1.50 at
        # 0.35) over 128-token answers, 1.56x -> 1.57x over 256-token ones (where copies are a smaller
        # part); open-ended prompts unchanged (1.03x / 1.11x).
        self.copies = AcceptanceRate(prior=0.9, weight=8.0, decay=0.98, idle_decay=1.0)

    def new_state(self, num_shifted_tokens: int) -> SpecState:
        return SpecState(NgramIndex(self.cfg.ngram_min, self.cfg.ngram_max), num_shifted_tokens,
                         AcceptanceRate(prior=self.cfg.prior_acceptance),
                         BackOff(next_cooldown=self.cfg.cooldown_steps))

    def acceptance(self, state: SpecState, match_len: int) -> float:
        """The chance each proposed token is right: what this sequence's recent proposals say, and what
        matches of this length say across the engine, equally."""
        return (state.rate.value + self.by_length[match_len].value) / 2

    def propose(self, state: SpecState | None, token_ids: list[int], num_shifted_tokens: int, cap: int,
                num_rows: int = 1) -> tuple[SpecState, list[int]]:
        """Up to cap proposals after token_ids (the sequence's context), as many as its acceptance rate
        makes worth their rows in a step of num_rows rows; also the (possibly new) state to keep."""
        if state is None or state.num_shifted_tokens != num_shifted_tokens:
            state = self.new_state(num_shifted_tokens)
        k, match, copying = 0, None, False
        if not state.backoff.cooling() and cap > 0:
            cost = step_cost(self.cfg, self.costs, len(token_ids), num_rows)
            # No lookup where no match could pay (a large batch under the prior): the index catches up
            # on the ids appended meanwhile at its next lookup, at the cost of copying them.
            if isinstance(cost, StepCosts) or could_pay((state.rate.value + self._best_length_rate) / 2,
                                                        num_rows, cost):
                match = state.index.find(token_ids)
            if match is not None:
                copying = state.index.agreement(match, self.cfg.copy_tokens) >= self.cfg.copy_tokens
                alpha = self.copies.value if copying else self.acceptance(state, match.n)
                k = best_num_tokens(alpha, num_rows, cost, cap)
        draft = continuation(token_ids, match, k) if k else []
        state.match_len = match.n if draft else 0
        state.copying = bool(draft) and copying
        if not draft:
            state.rate.idle()
        return state, draft

    def any_could_pay(self, states: list[SpecState | None], num_rows: int) -> bool:
        """Whether a proposal of any of these sequences (their states; None: none yet) could pay in a
        step of num_rows rows (see any_could_pay below); alpha as propose() judges it before its lookup."""
        return any_could_pay(self.cfg, self.costs, num_rows, max(
            (self.cfg.prior_acceptance if s is None else s.rate.value) for s in states), self._best_length_rate)

    def propose_many(self, asks: list[tuple[SpecState | None, list[int], int, int]],
                     num_rows: int = 1) -> list[tuple[SpecState, list[int]]]:
        """propose() for several sequences (state, context, shifted tokens, cap): lookups are per sequence."""
        return [self.propose(state, ids, shifted, cap, num_rows) for state, ids, shifted, cap in asks]

    def observe(self, state: SpecState, num_draft_tokens: int, num_accepted: int) -> None:
        """After a verification: update the acceptance rate; count a miss, or forgive them all; enough
        misses in a row start a cooldown."""
        state.rate.observe(num_draft_tokens, num_accepted)
        if state.match_len:
            self.by_length[state.match_len].observe(num_draft_tokens, num_accepted)
            self._best_length_rate = max(r.value for r in self.by_length)
        if state.copying:
            self.copies.observe(num_draft_tokens, num_accepted)
        state.backoff.observe(self.cfg, num_accepted)

    nbytes = 0  # memory it holds besides each sequence's index (a draft model holds its weights and cache)
    searches_prediction = True  # a request's predicted output is looked up too (Speculator._lookup_ids)

    def forget(self, state: SpecState) -> None:
        """The sequence is done or starts over: an n-gram index holds nothing outside itself."""
