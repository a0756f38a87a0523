"""The concurrency-sweep chart of `tokenmill bench serve --sweep ... --chart PATH.png`: throughput
and latency against concurrency. matplotlib (Agg, no display) is imported only here."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def sweep_chart(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r["output_tok_s"] for r in runs], "o-", label="output tok/s")
    ax1.plot(xs, [r["total_tok_s"] for r in runs], "s--", label="total tok/s")
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("tokens / s")
    ax1.set_title("throughput")
    ax2.plot(xs, [r["ttft_ms"]["p50"] for r in runs], "o-", label="TTFT p50")
    ax2.plot(xs, [r["ttft_ms"]["p95"] for r in runs], "o:", label="TTFT p95")
    ax2.plot(xs, [r["itl_ms"]["p50"] for r in runs], "s-", label="ITL p50")
    ax2.plot(xs, [r["itl_ms"]["p95"] for r in runs], "s:", label="ITL p95")
    ax2.plot(xs, [r["e2e_ms"]["p50"] for r in runs], "^-", label="E2E p50")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title("latency")
    for ax in (ax1, ax2):
        if len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
