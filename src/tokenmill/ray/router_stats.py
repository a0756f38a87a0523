"""What the prefix-aware router did, counted in the process it runs in (the ingress replica, whose
deployment handle owns the router), and the replicas' latest metrics as their routing stats
brought them; the ingress renders both on GET /metrics."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tokenmill.ray.routing_policy import DECISIONS


@dataclass
class RouterStats:
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISIONS, 0))
    keyed_requests: int = 0        # requests whose prompt gave at least one full block
    blocks_queried: int = 0        # full prompt blocks of those requests
    blocks_matched: int = 0        # of which the replica they went to already held
    replica_metrics: dict[str, str] = field(default_factory=dict)  # replica id -> its /metrics text
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, decision: str, queried: int, matched: int) -> None:
        with self.lock:
            self.decisions[decision] = self.decisions.get(decision, 0) + 1
            if queried:
                self.keyed_requests += 1
                self.blocks_queried += queried
                self.blocks_matched += matched

    @property
    def hit_rate(self) -> float:
        return self.blocks_matched / self.blocks_queried if self.blocks_queried else 0.0

    def set_replica_metrics(self, texts: dict[str, str]) -> None:
        with self.lock:
            self.replica_metrics = dict(texts)


# One per process: the router and the ingress that renders it share the ingress replica's process.
ROUTER_STATS = RouterStats()
