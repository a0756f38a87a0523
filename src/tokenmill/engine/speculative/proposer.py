"""Which tokens a decoding sequence proposes this step, and how it backs off when they keep failing.

Each sequence keeps its own SpecState (its n-gram index, its acceptance rate, its record of misses),
made on its first proposal. How many tokens it proposes follows from its acceptance rate and the step's
size (policy.py), so proposals that are seldom right shrink to none; and a sequence whose proposals are
rejected outright several times in a row stops proposing for a while (doubling while retries fail).
Either way, on text that does not repeat, a speculating sequence costs what an ordinary one does."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.speculative.config import SpecConfig
from tokenmill.engine.speculative.ngram import NgramIndex
from tokenmill.engine.speculative.policy import AcceptanceRate, best_num_tokens


@dataclass
class SpecState:
    index: NgramIndex
    num_shifted_tokens: int  # the sequence's at creation: a context shift rewrites the context
    rate: AcceptanceRate
    misses: int = 0          # verifications in a row that accepted nothing
    cooldown: int = 0        # steps left without proposals
    next_cooldown: int = 0   # the length of the next cooldown (doubles while retries fail)


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

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg

    def new_state(self, num_shifted_tokens: int) -> SpecState:
        return SpecState(NgramIndex(self.cfg.ngram_min, self.cfg.ngram_max), num_shifted_tokens,
                         AcceptanceRate(prior=self.cfg.prior_acceptance), next_cooldown=self.cfg.cooldown_steps)

    def propose(self, state: SpecState | None, token_ids: list[int], num_shifted_tokens: int, cap: int,
                num_rows: int = 1) -> tuple[SpecState, list[int]]:
        """Up to cap proposals after token_ids (the sequence's context), as many as its acceptance rate
        makes worth their rows in a step of num_rows rows; also the (possibly new) state to keep."""
        if state is None or state.num_shifted_tokens != num_shifted_tokens:
            state = self.new_state(num_shifted_tokens)
        k = 0
        if state.cooldown > 0:
            state.cooldown -= 1
        elif cap > 0:
            k = best_num_tokens(state.rate.value, num_rows, self.cfg.row_cost, cap)
        # Looked up even for k = 0: the index stays current, so catching up later costs no more.
        draft = state.index.propose(token_ids, k)
        if not draft:
            state.rate.idle()
        return state, draft

    def observe(self, state: SpecState, num_draft_tokens: int, num_accepted: int) -> None:
        """After a verification: update the acceptance rate; count a miss, or forgive them all; enough
        misses in a row start a cooldown."""
        state.rate.observe(num_draft_tokens, num_accepted)
        if num_accepted:
            state.misses = 0
            state.next_cooldown = self.cfg.cooldown_steps
            return
        state.misses += 1
        if state.misses >= self.cfg.max_misses:
            state.misses = self.cfg.max_misses - 1  # one more miss after the cooldown starts another
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, self.cfg.max_cooldown_steps)
