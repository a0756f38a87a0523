"""Prometheus' text format (version 0.0.4): each metric family's HELP and TYPE lines once, then all
of its samples. A family is written in one call with every label set it has, so a page never
repeats a family's header (what a scraper rejects) however many models or devices it covers."""
from __future__ import annotations

from tokenmill.engine.stats import HistogramSnapshot

Labels = dict[str, str]


def escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


class Writer:
    """Lines of one page; `labels` go first on every sample (before a family's own labels)."""

    def __init__(self, labels: Labels):
        self.lines: list[str] = []
        self.base = labels

    def _labels(self, extra: Labels | None = None) -> str:
        labels = {**self.base, **(extra or {})}
        return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}" if labels else ""

    def _header(self, name: str, kind: str, help_: str) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]

    def metric(self, name: str, kind: str, help_: str, value: float, extra: Labels | None = None) -> None:
        self.series(name, kind, help_, [(extra or {}, value)])

    def labelled(self, name: str, kind: str, help_: str, values: dict[str, float], label: str) -> None:
        self.series(name, kind, help_, [({label: key}, value) for key, value in sorted(values.items())])

    def series(self, name: str, kind: str, help_: str, rows: list[tuple[Labels, float]]) -> None:
        """One metric with a sample per label set (its HELP and TYPE once)."""
        self._header(name, kind, help_)
        self.lines += [f"{name}{self._labels(labels)} {format_value(value)}" for labels, value in rows]

    def histogram(self, name: str, help_: str, h: HistogramSnapshot) -> None:
        self.histograms(name, help_, [({}, h)])

    def histograms(self, name: str, help_: str, rows: list[tuple[Labels, HistogramSnapshot]]) -> None:
        """One histogram family with a set of buckets, sum and count per label set."""
        self._header(name, "histogram", help_)
        for labels, h in rows:
            for bound, count in h.buckets:
                self.lines.append(f"{name}_bucket{self._labels({**labels, 'le': format_value(bound)})} {count}")
            self.lines.append(f"{name}_sum{self._labels(labels)} {h.sum!r}")
            self.lines.append(f"{name}_count{self._labels(labels)} {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""
