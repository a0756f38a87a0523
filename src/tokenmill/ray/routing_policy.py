"""Which replica a request should go to, decided from plain numbers (no Ray here, so it is tested
alone): the session's replica, else the one holding the longest prefix of the prompt, unless that
replica is busier than the least-loaded one by more than `max_imbalance` requests; else the
least-loaded. A prefix hit saves the prefill of every matched block, but a queue is paid in whole
requests, so past some imbalance the cache is not worth the wait.

A match must also cover a good part of the prompt (`min_match_fraction`): every chat request
starts with the same template header (and often the same default system prompt), and a router
that chased those few shared blocks would pile all traffic onto whichever replica saw it first."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SESSION, PREFIX, LEAST_LOADED, OVERLOADED = "session", "prefix", "least_loaded", "overloaded"
DECISIONS = (SESSION, PREFIX, LEAST_LOADED, OVERLOADED)


@dataclass(frozen=True)
class Candidate:
    replica: str     # the replica's unique id
    load: int        # its ongoing requests (running + queued), as last known
    matched: int     # leading blocks of this request's prompt it holds


@dataclass(frozen=True)
class Choice:
    preferred: str | None    # None: any of the least-loaded
    decision: str
    matched: int             # blocks the preferred replica holds (0 without one)


@dataclass(frozen=True)
class PolicyConfig:
    max_imbalance: int = 4        # requests the preferred replica may have above the least-loaded one
    min_match_blocks: int = 1     # shorter matches are not worth giving up balance for
    min_match_fraction: float = 0.5  # ... nor matches of less than this part of the prompt's blocks


def choose(candidates: Sequence[Candidate], session_replica: str | None, cfg: PolicyConfig,
           num_blocks: int = 0) -> Choice:
    """num_blocks: the request's full prompt blocks (what a match is a fraction of)."""
    if not candidates:
        return Choice(None, LEAST_LOADED, 0)
    least = min(c.load for c in candidates)
    by_id = {c.replica: c for c in candidates}
    sticky = by_id.get(session_replica) if session_replica else None
    if sticky is not None and sticky.load - least <= cfg.max_imbalance:
        return Choice(sticky.replica, SESSION, sticky.matched)
    # Longest match first; among equal matches the less loaded one.
    best = max(candidates, key=lambda c: (c.matched, -c.load))
    if best.matched >= max(cfg.min_match_blocks, cfg.min_match_fraction * num_blocks):
        if best.load - least <= cfg.max_imbalance:
            return Choice(best.replica, PREFIX, best.matched)
        return Choice(None, OVERLOADED, 0)
    return Choice(None, LEAST_LOADED, 0)
