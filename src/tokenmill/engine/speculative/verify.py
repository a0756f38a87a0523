"""Checking a sequence's proposed tokens against the model, in the step that computed them.

A speculating sequence's chunk has 1 + k rows: its last token and the k proposals d_1..d_k. Row j's
logits are the model's distribution for the token after d_j (after the last token for j = 0), so the
sampler draws one token per row exactly as k + 1 ordinary steps would, each from its own row. The
proposals agreeing with those draws are accepted, up to the first disagreement; the model's own token
there (or the bonus token of row k, when all k agree) comes with them:

    emitted = sampled[:a + 1]  where a = the number of leading j with sampled[j] == d_{j+1}

Greedy rows: row j's argmax is the token greedy decoding emits at that position whenever d_1..d_j were
right, so the output is the one without speculation, bit for bit (the kernels compute each row the same
way whatever else is in the step).

Sampled rows: for a proposer that puts all its mass on one token x (prompt lookup), the standard
speculative rule (Leviathan et al., Chen et al.) accepts x with probability min(1, p(x)/q(x)) = p(x) and
otherwise draws from p with x removed, renormalised. Drawing t ~ p and accepting x iff t == x is that
rule: P(accept) = p(x), and a rejected draw is distributed as p given t != x. So the distribution of the
output is the model's, and each emitted token consumes exactly one draw at its position.

Seeded requests: row j draws from a copy of the request's generator advanced by j draws (one per
position before it); afterwards the generator takes the state of the last emitted row's copy. The
generator therefore advances one draw per emitted token, as without speculation, and the same seed
gives the same output with speculation on or off."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def num_accepted(draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> int:
    """How many leading proposals the model's own tokens agree with (sampled_ids[j] is row j's token,
    the one after draft j - 1; len(sampled_ids) == len(draft_ids) + 1)."""
    a = 0
    while a < len(draft_ids) and sampled_ids[a] == draft_ids[a]:
        a += 1
    return a


def _advance(gen: torch.Generator) -> None:
    """One draw, as the sampler takes for one seeded row (a single float32 uniform)."""
    torch.rand((1,), generator=gen)


def row_generators(gen: torch.Generator, num_rows: int) -> list[torch.Generator]:
    """Copies of gen for the rows of one chunk: row j's is advanced by j draws. gen is not touched."""
    rows: list[torch.Generator] = []
    state = gen.get_state()
    for j in range(num_rows):
        g = torch.Generator(device=gen.device)
        g.set_state(state)
        if j:
            _advance(g)
        rows.append(g)
        state = g.get_state()
    return rows


def settle_generator(gen: torch.Generator, rows: list[torch.Generator], num_emitted: int) -> None:
    """After the rows were sampled: gen continues where the row of the last emitted token left off."""
    if num_emitted:
        gen.set_state(rows[num_emitted - 1].get_state())
