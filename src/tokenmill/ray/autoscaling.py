"""Ray Serve autoscaling on the engines' own queues. Serve's default policy counts HTTP requests
at a replica; what says a tokenmill replica is saturated is sequences waiting for a batch slot
(`vllm:num_requests_waiting`, which every replica reports in its autoscaling stats). Serve applies
min/max replicas, the up/downscaling factors and delays around this function."""
from __future__ import annotations

import math
from collections.abc import Mapping

WAITING = "num_requests_waiting"
RUNNING = "num_requests_running"


def desired_replicas(current: int, waiting: float, running: float, *, waiting_per_replica: float = 1.0,
                     idle_fraction: float = 0.5, slots: int = 64) -> int:
    """Replicas wanted for this much waiting and running work (totals over the replicas).

    Up: enough replicas to run the queue at today's per-replica batch (at least one more).
    Down by one: nothing waits and the running work would fit in one replica fewer at
    `idle_fraction` of its slots."""
    if current <= 0:
        return 1 if waiting + running > 0 else 0
    if waiting > waiting_per_replica * current:
        per_replica = max(running / current, 1.0)
        return current + max(1, math.ceil(waiting / per_replica))
    if waiting == 0 and current > 1 and running <= idle_fraction * slots * (current - 1):
        return current - 1
    return current


def _total(metrics: Mapping[str, Mapping[object, float]] | None, name: str) -> float:
    return float(sum((metrics or {}).get(name, {}).values()))


class WaitingQueuePolicy:
    """A Ray Serve autoscaling policy class (Serve builds it with `policy_kwargs` and calls it with a
    ray.serve.config.AutoscalingContext)."""

    def __init__(self, waiting_per_replica: float = 1.0, idle_fraction: float = 0.5, slots: int = 64):
        self.waiting_per_replica = waiting_per_replica
        self.idle_fraction = idle_fraction
        self.slots = slots

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics
        if not metrics or WAITING not in metrics:  # replicas not reporting yet: no evidence to act on
            return ctx.current_num_replicas, {}
        n = desired_replicas(ctx.current_num_replicas, _total(metrics, WAITING), _total(metrics, RUNNING),
                             waiting_per_replica=self.waiting_per_replica, idle_fraction=self.idle_fraction,
                             slots=self.slots)
        return n, {}
