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

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k proposals gives: the accepted run, plus the model's own token."""
    return sum(alpha ** i for i in range(k + 1))


def linear_cost(row_cost: float) -> Callable[[int], float]:
    """The prior cost model: a step of n rows costs 1 + row_cost * n (its fixed part is 1)."""
    return lambda rows: 1.0 + row_cost * rows


def best_num_tokens(alpha: float, num_rows: int, cost: float | Callable[[int], float], cap: int,
                    draft_cost: float = 0.0) -> int:
    """The k in [0, cap] giving the most tokens per unit of step time, for one sequence in a step of
    num_rows other-wise single-token rows (itself included). cost: a step's cost by its rows (StepCosts
    learned, or a float: linear_cost's row cost); draft_cost: what making one proposal costs, as a
    share of a one-row step (a draft model's step; prompt lookup's is nothing)."""
    step = linear_cost(cost) if isinstance(cost, (int, float)) else cost
    r = max(num_rows, 1)
    # Each step size priced once, in one call where the model can (StepCosts.span): this runs for every
    # sequence whose lookup matched, every step, and a call per row count was most of its time.
    span = getattr(step, "span", None)
    seconds = span(r, r + cap) if span is not None else [step(n) for n in range(r, r + cap + 1)]
    draft_step = draft_cost * step(1) if draft_cost else 0.0
    best_k, best = 0, r / seconds[0]
    tokens, p = 1.0, 1.0  # expected_tokens(alpha, k), kept up as k grows
    for k in range(1, cap + 1):
        p *= alpha
        tokens += p
        rate = (r - 1 + tokens) / (seconds[k] + draft_step * k)
        if rate > best * (1.0 + 1e-9):
            best_k, best = k, rate
    return best_k


def could_pay(alpha: float, num_rows: int, row_cost: float) -> bool:
    """Under the prior cost model (a float row cost), whether any proposal at acceptance alpha could
    pay in a step of num_rows rows: one token pays iff alpha > r c / (1 + c r), and if one does not,
    none does (expected tokens are concave in k, the cost linear). Checked before a lookup, so that
    sequences in a large batch skip it: a 64-sequence burst spent 2.7% of its time proposing nothing."""
    r = max(num_rows, 1)
    return alpha > r * row_cost / (1.0 + row_cost * r)


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


@dataclass
class StepCosts:
    """What a step of n rows costs here, learned from the engine's own decode steps (steps with a prefill
    chunk are not recorded: a prompt's rows take no logits, and a request's first steps run cold). The
    kernels' cost is not linear in rows (SmolLM2 on the 2-core Sapphire Rapids box, one thread, 300
    tokens of context: 1-10 rows took 9.3, 10.9, 14.3, 17.3, 19.3, 20.1, 23.1, 24.9, 25.3, 28.6 ms; the
    AVX-512 matmuls take rows three at a time), so proposals sized from what this machine did beat a
    fixed row cost: the input-grounded prompts of `bench speculative` went 1.71x -> 1.75x and 1.73x ->
    1.78x against the linear model (two runs, the two alternated on one engine).

    What is kept is robust to a shared machine, where other work only ever adds time to a step: a
    one-row step costs the least of the last `window` one-row steps (it recurs every plain decode step,
    so it follows the machine's speed and the growing context), and a step of r rows the least of its
    last `window` observations as a multiple of that one-row cost when each was taken. A row count not
    seen for `stale_steps` recorded steps is forgotten, so that it is tried again. Without both, one
    step slowed by a neighbour (13.6 ms for 2 rows where 4 was usual) made every larger step look dear
    for good: the proposer stopped proposing, so the estimate was never corrected, and the grounded
    prompts of `bench speculative` fell to 0.9-1.2x on their second round in one engine.

    Row counts never seen (or forgotten) are interpolated between seen ones (extrapolated past the
    largest with prior_row_cost), so the model only has to see a few."""
    prior_row_cost: float = 0.27
    window: int = 4             # observations kept per row count
    stale_steps: int = 64       # recorded steps after which a row count's observations are forgotten
    max_rows: int = 256         # larger steps (long prefill chunks) are not worth remembering
    decay: float = 0.7          # weight of the old average of the rest of a step per new observation
    ones: deque = field(default_factory=deque)                # the last one-row steps' seconds
    ratios: dict[int, deque] = field(default_factory=dict)    # rows -> their last steps, in one-row steps
    last_seen: dict[int, int] = field(default_factory=dict)   # rows -> the record count when last seen
    fixed: float | None = None  # seconds of a step outside the model and the sampler
    num_records: int = 0
    # Multiples of the one-row step by rows (index), worked out for every row count at once: a proposal
    # is sized by pricing each k up to the cap (best_num_tokens), and pricing them one by one took ~80 us
    # for each lookup that matched, more than the lookup itself. They are ratios, so a one-row step (most
    # steps) leaves them as they are: they are worked out again after a step of more rows, or once a row
    # count they rest on is forgotten (record count _valid_until).
    _multiples: list[float] = field(default_factory=list, repr=False)
    _valid_until: float = field(default=0.0, repr=False)

    @property
    def ready(self) -> bool:
        return bool(self.ones) and self.fixed is not None

    @property
    def one_row_seconds(self) -> float:
        return min(self.ones)

    def record(self, rows: int, model_seconds: float, other_seconds: float) -> None:
        if rows < 1 or rows > self.max_rows or model_seconds <= 0:
            return
        self.num_records += 1
        if self.num_records >= self._valid_until:  # a row count is forgotten now (staleness counts records)
            self._multiples = []
        if rows == 1:
            self.ones.append(model_seconds)
            if len(self.ones) > self.window:
                self.ones.popleft()
        elif self.ones:  # a multiple of what one row costs now
            kept = self.ratios.setdefault(rows, deque())
            kept.append(model_seconds / self.one_row_seconds)
            if len(kept) > self.window:
                kept.popleft()
            self._multiples = []
        else:
            return
        self.last_seen[rows] = self.num_records
        other = max(other_seconds, 0.0)
        self.fixed = other if self.fixed is None else self.decay * self.fixed + (1 - self.decay) * other

    @property
    def seconds(self) -> dict[int, float]:
        """What a step of each row count still remembered costs now (none before a one-row step)."""
        if not self.ones:
            return {}
        return {1: self.one_row_seconds, **{r: self.one_row_seconds * m for r, m in self._fresh().items()}}

    def __call__(self, rows: int) -> float:
        """Seconds a step of `rows` rows is expected to take (ready must hold)."""
        return self.model_seconds(rows) + (self.fixed or 0.0)

    def model_seconds(self, rows: int) -> float:
        """Never below what fewer rows took: observations at other moments (another context length)
        must not make an extra row look free or cheaper than none."""
        rows = max(rows, 1)
        self._cover(rows)
        return self.one_row_seconds * self._multiples[rows]

    def span(self, first: int, last: int) -> list[float]:
        """[self(n) for n in first..last] (first >= 1, ready must hold), in one pass."""
        self._cover(last)
        one, fixed = self.one_row_seconds, self.fixed or 0.0
        return [one * m + fixed for m in self._multiples[first:last + 1]]

    def _cover(self, rows: int) -> None:
        if rows >= len(self._multiples):
            fresh = self._fresh()
            self._multiples = self._sweep(max(rows, 2 * len(self._multiples), 32), fresh)
            self._valid_until = min((self.last_seen[r] + self.stale_steps for r in fresh), default=float("inf"))

    def _fresh(self) -> dict[int, float]:
        """rows -> the least of its kept multiples, for the row counts seen in the last stale_steps."""
        return {r: min(kept) for r, kept in self.ratios.items()
                if self.num_records - self.last_seen[r] < self.stale_steps}

    def _sweep(self, most_rows: int, fresh: dict[int, float]) -> list[float]:
        """The multiple for each row count 0..most_rows: a count seen lately costs the least of its
        kept multiples, one between two seen counts is interpolated, one past the largest extrapolated
        with prior_row_cost from it; then none below what a smaller count seen lately costs. fresh: _fresh()."""
        seen = sorted(fresh)
        out = [1.0, 1.0]
        i, below, at_below, most = 0, 1, 1.0, 1.0
        for rows in range(2, most_rows + 1):
            while i < len(seen) and seen[i] < rows:
                below, at_below = seen[i], fresh[seen[i]]
                most = max(most, at_below)
                i += 1
            if i < len(seen) and seen[i] == rows:
                estimate = fresh[rows]
            elif i < len(seen):
                above = seen[i]
                estimate = at_below + (rows - below) / (above - below) * (fresh[above] - at_below)
            else:
                estimate = at_below + (rows - below) * self.prior_row_cost
            out.append(max(estimate, most))
        return out
