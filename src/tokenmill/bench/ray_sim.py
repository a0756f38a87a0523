"""What would a cluster of R replicas do with the prefix router, against Ray Serve's default
(power of two choices)? A discrete-event simulation driven by the same decision function the
router runs (tokenmill.ray.routing_policy.choose), with per-replica speeds measured on this machine
(`tokenmill bench ray`), so the question "what about 16 nodes" gets numbers, not adjectives.

Model (deliberately simple; what it leaves out is said here):
  - requests arrive as a Poisson stream; each is one of G shared prefixes (Zipf popularity) + its
    own question; the prefix is reused only where it is cached;
  - each replica holds an LRU of whole prefixes in `kv_tokens` of cache, and serves requests in
    arrival order at `prefill_tps` for uncached prompt tokens and `decode_tps` for output tokens
    (its measured throughput at saturation; continuous batching is folded into those rates, so
    latencies are those of a loaded replica, not of an idle one);
  - the router sees exact queue lengths and exact cache contents (the real one sees them a stats
    period late, softened by remembering where it sent each prefix).

    tokenmill bench ray-sim [--replicas 16 --groups 64 --load 0.8 --prefill-tps 900 --decode-tps 60]
"""
from __future__ import annotations

import argparse
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tokenmill.bench.common import percentiles
from tokenmill.ray.routing_policy import Candidate, PolicyConfig, choose


@dataclass
class Replica:
    capacity: int                                   # prefixes its cache holds
    cache: OrderedDict = field(default_factory=OrderedDict)
    busy_until: float = 0.0
    finishes: deque = field(default_factory=deque)  # finish times of requests assigned, in order
    busy_seconds: float = 0.0

    def load(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        return len(self.finishes)

    def holds(self, group: int) -> bool:
        return group in self.cache

    def touch(self, group: int) -> None:
        self.cache[group] = True
        self.cache.move_to_end(group)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


def simulate(args: argparse.Namespace, router: str, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    per_prefix = max(1, args.kv_tokens // args.prefix_len)
    replicas = [Replica(per_prefix) for _ in range(args.replicas)]
    weights = [1 / (g + 1) ** args.zipf for g in range(args.groups)]
    miss_service = (args.prefix_len + args.question_len) / args.prefill_tps + args.max_tokens / args.decode_tps
    rate = args.load * args.replicas / miss_service  # `load` of what the cluster serves with no cache at all
    blocks = (args.prefix_len + args.question_len) // args.block_size
    prefix_blocks = args.prefix_len // args.block_size
    policy = PolicyConfig(max_imbalance=args.max_imbalance)
    now, hit_tokens, prompt_tokens = 0.0, 0, 0
    ttft, e2e = [], []
    for _ in range(args.requests):
        now += rng.expovariate(rate)
        group = rng.choices(range(args.groups), weights)[0]
        if router == "prefix":
            cands = [Candidate(str(i), r.load(now), prefix_blocks if r.holds(group) else 0)
                     for i, r in enumerate(replicas)]
            choice = choose(cands, None, policy, blocks)
            if choice.preferred is not None:
                target = int(choice.preferred)
            else:
                least = min(c.load for c in cands)
                target = int(rng.choice([c for c in cands if c.load == least]).replica)
        else:  # power of two choices
            a, b = rng.sample(range(args.replicas), 2) if args.replicas > 1 else (0, 0)
            target = a if replicas[a].load(now) <= replicas[b].load(now) else b
        r = replicas[target]
        hit = args.prefix_len if r.holds(group) else 0
        r.touch(group)
        uncached = args.prefix_len + args.question_len - hit
        service = uncached / args.prefill_tps + args.max_tokens / args.decode_tps
        start = max(now, r.busy_until)
        r.busy_until = start + service
        r.busy_seconds += service
        r.finishes.append(r.busy_until)
        hit_tokens += hit
        prompt_tokens += args.prefix_len + args.question_len
        ttft.append(start - now + uncached / args.prefill_tps)
        e2e.append(r.busy_until - now)
    busy = [r.busy_seconds for r in replicas]
    t, e = percentiles(ttft), percentiles(e2e)
    return {"hit_rate": hit_tokens / prompt_tokens, "req_per_s": args.requests / max(r.busy_until for r in replicas),
            "offered_req_per_s": rate, "ttft_p50": t["p50"], "ttft_p95": t["p95"], "e2e_p50": e["p50"],
            "e2e_p95": e["p95"], "busiest_over_mean": max(busy) / (sum(busy) / len(busy))}


def build_parser(prog: str = "tokenmill bench ray-sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--groups", type=int, default=64, help="distinct shared prefixes")
    p.add_argument("--zipf", type=float, default=1.0, help="prefix popularity skew (0 = uniform)")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of the cluster's "
                                                           "no-cache capacity")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-tokens", type=int, default=16384, help="prefix cache per replica, in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-tps", type=float, default=900.0, help="measured prompt tok/s of one replica")
    p.add_argument("--decode-tps", type=float, default=60.0, help="measured output tok/s of one loaded replica")
    p.add_argument("--max-imbalance", type=int, default=4)
    return p


def main(argv: list[str] | None = None, prog: str = "tokenmill bench ray-sim") -> int:
    args = build_parser(prog).parse_args(argv)
    print(f"{args.replicas} replicas, {args.groups} prefixes of {args.prefix_len} tokens (zipf {args.zipf}), "
          f"cache {args.kv_tokens} tokens/replica, load {args.load} of the no-cache capacity")
    print(f"{'router':8} {'hit rate':>9} {'req/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'e2e p95':>8} "
          f"{'busiest/mean':>13}")
    for router in ("prefix", "default"):
        r = simulate(args, router)
        print(f"{router:8} {r['hit_rate'] * 100:>8.1f}% {r['req_per_s']:>8.2f} {r['ttft_p50']:>8.2f}s "
              f"{r['ttft_p95']:>8.2f}s {r['e2e_p95']:>7.1f}s {r['busiest_over_mean']:>13.2f}")
    return 0
