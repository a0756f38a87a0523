"""How many tokens a sequence should propose in a step: as many as pay for themselves.

On a CPU a step's time is roughly a fixed part (reading the weights once) plus a part per row
(the arithmetic of each row, and its attention over the context): t(rows) = t0 * (1 + row_cost * rows).
SmolLM2 on the 2-core Sapphire Rapids box, one thread: 1, 2, 3, 5, 9 rows of a 300-token context cost
1, 1.13, 1.53, 2.06, 2.78 one-row steps (row_cost about 0.3); of a 4,000-token context 1, 1.49, 1.92,
2.68, 3.95 (about 0.6; the proposer scales row_cost with the context, SpecConfig.row_cost_context). A sequence whose proposals are each accepted with probability alpha (given the ones
before it were) gets E(k) = 1 + alpha + ... + alpha^k tokens from k proposals. With R sequences
decoding in the step, proposing k tokens changes the step's tokens per unit of time from
R / (1 + row_cost R) to (R - 1 + E(k)) / (1 + row_cost (R + k)); the best k maximises it, and 0 wins
when no k gains. Alone, a sequence with alpha = 0.9 proposes 5-6 tokens, with alpha = 0.6 two, with
alpha = 0.3 none; in a batch of 16 the fixed part is shared so widely that no alpha pays for a row.

alpha is each sequence's own estimate (AcceptanceRate), from its recent verifications."""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k proposals gives: the accepted run, plus the model's own token."""
    return sum(alpha ** i for i in range(k + 1))


def best_num_tokens(alpha: float, num_rows: int, row_cost: float, cap: int, draft_cost: float = 0.0) -> int:
    """The k in [0, cap] giving the most tokens per unit of step time, for one sequence in a step of
    num_rows other-wise single-token rows (itself included). draft_cost: what making one proposal
    costs, in the same unit (a draft model's step; prompt lookup's is nothing)."""
    r = max(num_rows, 1)
    best_k, best = 0, r / (1.0 + row_cost * r)
    for k in range(1, cap + 1):
        rate = (r - 1 + expected_tokens(alpha, k)) / (1.0 + row_cost * (r + k) + draft_cost * k)
        if rate > best * (1.0 + 1e-9):
            best_k, best = k, rate
    return best_k


@dataclass
class AcceptanceRate:
    """A sequence's chance that a proposed token is accepted, given the ones before it were: accepted
    over tried, both decaying so that recent verifications count most, and pulled towards `prior` by
    `weight` pseudo-trials. Steps without proposals decay the record too, so a sequence that stopped
    proposing drifts back to the prior and tries again."""
    prior: float = 0.6
    weight: float = 2.0
    decay: float = 0.8       # per verification
    idle_decay: float = 0.95  # per step without a verification
    accepted: float = 0.0
    tried: float = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.tried + self.weight)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """The accepted proposals were each a success; the first rejected one (if any) a failure; the
        ones after it were never judged."""
        self.accepted = self.decay * self.accepted + num_accepted
        self.tried = self.decay * self.tried + num_accepted + (num_accepted < num_proposed)

    def idle(self) -> None:
        self.accepted *= self.idle_decay
        self.tried *= self.idle_decay
