"""GET /metrics of a Ray deployment: every replica's own tokenmill metrics with a `replica` label
(so one scrape of the ingress shows each replica, and sums across them still work), then the
router's counters and prefix hit rate."""
from __future__ import annotations

import re

from tokenmill.ray.router_stats import RouterStats
from tokenmill.ray.routing_policy import DECISIONS
from tokenmill.server.metrics import Writer

# name{labels} value  |  name value
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)\s*$")


def sample_value(text: str, name: str) -> float | None:
    """The first sample of metric `name` in a Prometheus text page (unlabelled gauges, counters)."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            return float(m.group(3))
    return None


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def relabel(text: str, replica: str) -> list[str]:
    """The page's sample lines with replica="..." added; HELP/TYPE lines are kept as they are."""
    label = f'replica="{_escape(replica)}"'
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            out.append(line)
            continue
        name, labels, value = m.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f"{name}{{{label}{',' if inner else ''}{inner}}} {value}")
    return out


def merge(pages: dict[str, str]) -> list[str]:
    """Several replicas' pages as one: each metric's HELP/TYPE once, then every replica's samples."""
    order: list[str] = []
    header: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica in sorted(pages):
        for line in relabel(pages[replica], replica):
            if line.startswith("# "):
                parts = line.split(" ", 3)
                name = parts[2] if len(parts) > 2 else ""
                if name not in header:
                    header[name] = []
                    order.append(name)
                if line not in header[name]:
                    header[name].append(line)
            elif line:
                m = _SAMPLE.match(line)
                base = m.group(1) if m else ""
                family = next((n for n in (base, base.rsplit("_", 1)[0]) if n in header), base)
                samples.setdefault(family, []).append(line)
                if family not in header:
                    header[family] = []
                    order.append(family)
    return [line for name in order for line in (*header[name], *samples.get(name, []))]


def render(stats: RouterStats) -> str:
    with stats.lock:
        pages = dict(stats.replica_metrics)
        decisions = dict(stats.decisions)
        keyed, queried, matched = stats.keyed_requests, stats.blocks_queried, stats.blocks_matched
    w = Writer({})
    w.metric("tokenmill:router_replicas", "gauge", "Replicas the router currently knows.", len(pages))
    w.labelled("tokenmill:router_requests_total", "counter", "Requests routed, by the rule that placed them: "
               "session, prefix, least_loaded, overloaded (the prefix holder was too busy).",
               {d: decisions.get(d, 0) for d in DECISIONS}, "decision")
    w.metric("tokenmill:router_keyed_requests_total", "counter", "Routed requests with at least one full prompt "
             "block.", keyed)
    w.metric("tokenmill:router_prefix_blocks_queried_total", "counter", "Full prompt blocks of routed requests.",
             queried)
    w.metric("tokenmill:router_prefix_blocks_matched_total", "counter", "Of those, blocks the chosen replica "
             "already held.", matched)
    w.metric("tokenmill:router_prefix_hit_rate", "gauge", "matched / queried prompt blocks since start.",
             matched / queried if queried else 0.0)
    return "\n".join([*merge(pages), *w.lines]) + "\n"
