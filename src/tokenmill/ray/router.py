"""Prefix-aware routing as a Ray Serve RequestRouter (the extension point Serve gives a deployment
to choose its replicas): it runs inside each deployment handle, i.e. in the ingress replicas.

What a replica holds comes from two sources: the prefix summary it publishes in its routing stats
(every `request_routing_stats_period_s`), and what this router itself sent it since, remembered
for a few periods, because two requests sharing a prefix often arrive closer together than a stats
period and the second must follow the first. The decision itself is routing_policy.choose; here
are only Ray's types and the bookkeeping.

Serve pickles this module by value into each handle's process, so the process-wide counters are
reached through their module (pickled by reference), never bound here as a global of their own."""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tokenmill.ray.prefix_summary import RoutingKey, unpack
from tokenmill.ray import router_stats
from tokenmill.ray.routing_policy import LEAST_LOADED, Candidate, Choice, PolicyConfig, choose

RECENT_SECONDS = 30.0       # how long a routed prefix counts as held without the replica saying so
MAX_SESSIONS = 100_000
MAX_RECENT_BLOCKS = 65_536  # per replica


def _routing_key(pending: PendingRequest | None) -> RoutingKey:
    if pending is None or not pending.args:
        return RoutingKey()
    key = getattr(pending.args[0], "routing", None)
    return key if isinstance(key, RoutingKey) else RoutingKey()


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, max_imbalance: int = 4, min_match_blocks: int = 1, min_match_fraction: float = 0.5,
                         recent_seconds: float = RECENT_SECONDS, **_: Any) -> None:
        self.policy = PolicyConfig(max_imbalance, min_match_blocks, min_match_fraction)
        self.recent_seconds = recent_seconds
        self._summaries: dict[str, tuple[bytes, frozenset[bytes]]] = {}  # replica -> (blob, keys)
        self._recent: dict[str, OrderedDict[bytes, float]] = {}             # replica -> key -> expiry
        self._sessions: OrderedDict[str, str] = OrderedDict()                # session -> replica
        # request -> what was decided, until Serve says where it went (cancelled ones age out)
        self._choices: OrderedDict[str, tuple[Choice, dict[str, int], int]] = OrderedDict()

    # --- what each replica holds -------------------------------------------------------------
    def _held(self, replica: RunningReplica) -> frozenset[bytes]:
        rid = replica.replica_id.unique_id
        blob = (replica.routing_stats or {}).get("prefix", b"")
        cached = self._summaries.get(rid)
        if cached is None or cached[0] != blob:
            cached = (blob, unpack(blob))
            self._summaries[rid] = cached
        return cached[1]

    def _matched(self, replica: RunningReplica, blocks: tuple[bytes, ...], now: float) -> int:
        if not blocks:
            return 0
        held = self._held(replica)
        recent = self._recent.get(replica.replica_id.unique_id, {})
        n = 0
        for key in blocks:
            if key not in held and recent.get(key, 0.0) < now:
                break
            n += 1
        return n

    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        stats = replica.routing_stats or {}
        return int(stats.get("waiting", 0)) + int(stats.get("running", 0))

    # --- RequestRouter -----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = _routing_key(pending_request)
        now = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        matched = {rid: self._matched(r, key.blocks, now) for rid, r in by_id.items()}
        candidates = [Candidate(rid, self._load(r), matched[rid]) for rid, r in by_id.items()]
        session_replica = self._sessions.get(key.session) if key.session else None
        choice = choose(candidates, session_replica, self.policy, len(key.blocks))
        if pending_request is not None:
            # A request that finds every replica full comes back here; Serve backs off between rounds.
            pending_request.routing_context.should_backoff = True
            self._choices[pending_request.metadata.internal_request_id] = (choice, matched, len(key.blocks))
            while len(self._choices) > MAX_SESSIONS:
                self._choices.popitem(last=False)
        # Shuffled first so equally loaded replicas share the work instead of the first taking it all.
        everyone = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=self._load)
        if choice.preferred is None:
            return [everyone]
        preferred = by_id[choice.preferred]
        return [[preferred], [r for r in everyone if r is not preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        decided = self._choices.pop(pending_request.metadata.internal_request_id, None)
        key = _routing_key(pending_request)
        if decided is not None:
            choice, matched, queried = decided
            # The preferred replica may have been full: count where the request really went.
            decision = choice.decision if choice.preferred in (None, rid) else LEAST_LOADED
            router_stats.ROUTER_STATS.record(decision, queried, matched.get(rid, 0))
        if key.session:
            self._sessions[key.session] = rid
            self._sessions.move_to_end(key.session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        if key.blocks:
            recent = self._recent.setdefault(rid, OrderedDict())
            expiry = time.monotonic() + self.recent_seconds
            for block in key.blocks:
                recent[block] = expiry
                recent.move_to_end(block)
            while len(recent) > MAX_RECENT_BLOCKS:
                recent.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_all_but({r.replica_id.unique_id for r in replicas})
        pages = {r.replica_id.unique_id: (r.routing_stats or {}).get("metrics", "") for r in replicas}
        router_stats.ROUTER_STATS.set_replica_metrics({rid: text for rid, text in pages.items() if text})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_all_but(set(r.unique_id for r in self.curr_replicas))

    def _forget_all_but(self, live: set[str]) -> None:
        for table in (self._summaries, self._recent):
            for rid in [rid for rid in table if rid not in live]:
                del table[rid]
        for session in [s for s, rid in self._sessions.items() if rid not in live]:
            del self._sessions[session]  # its replica is gone: the session moves on
