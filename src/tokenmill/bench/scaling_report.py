"""The text report of `tokenmill bench scaling` (scaling.py): the machine, one table per figure with
tokenmill, llama.cpp and the ratio per thread count, and the thread pool's proxy figures."""
from __future__ import annotations

from typing import Any

from tokenmill.bench.common import fmt

# (test, key in each side's entry, title)
METRICS = (("tg", "decode_tok_s", "single-stream decode tok/s"),
           ("pp", "prefill_tok_s", "prefill tok/s"),
           ("batch", "decode_tok_s", "{batch}-sequence decode tok/s"))


def _get(side: dict[str, Any], test: str, key: str) -> float | None:
    return (side.get(test) or {}).get(key)


def _header(r: dict[str, Any]) -> list[str]:
    m, c, plan = r["machine"], r["config"], r["llama_cpp"]
    cores = (f"{m['logical_cpus']} logical CPUs ({m['affinity_cpus']} in affinity), {m['physical_cores']} physical"
             if m.get("physical_cores") is not None else f"{m['logical_cpus']} logical CPUs")
    sources = []
    if plan.get("tg_pp"):
        sources.append(f"tg/pp from {plan['tg_pp']}")
    if plan.get("batch"):
        sources.append(f"{c['batch']}-sequence decode from {plan['batch']}")
    return [f"scaling: {r['model']}",
            f"cpu: {m['cpu']}; {cores}",
            f"default threads: {m['default_threads']} ({m['default_threads_reason']})",
            f"cpu flags: {m['flags'] or 'none of ' + 'avx2/avx512f/vnni/bf16/amx'}",
            f"llama.cpp: {'; '.join(sources + plan.get('notes', [])) or 'n/a'}",
            "tests: " + "; ".join(_TEST_TEXT[t].format(**c) for t in r["tests"])
            + ("; tokenmill with speculative decoding (ngram)" if c.get("speculative") == "ngram" else "")]


_TEST_TEXT = {"tg": "tg = {tg_prompt_len}-token prompt, {tg_tokens} new tokens, greedy, EOS ignored, "
                    "median of {repeats}",
              "pp": "pp = {pp_tokens}-token prompt, median of {repeats}",
              "batch": "batch = {batch} x {batch_prompt_len}-token prompts, {batch_tokens} decode steps"}


def _rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(r["rows"], key=lambda row: row["threads"])


def _metric_table(r: dict[str, Any], test: str, key: str, title: str) -> list[str]:
    lines = ["", title.format(batch=r["config"]["batch"]),
             f"{'threads':>8}{'tokenmill':>12}{'llama.cpp':>12}{'ratio':>8}"]
    for row in _rows(r):
        tm, lc = _get(row["tokenmill"], test, key), _get(row["llama_cpp"], test, key)
        lines.append(f"{row['threads']:>8}{fmt(tm):>12}{fmt(lc):>12}{fmt(row['ratio'].get(test), 2):>8}")
    return lines


def _per(p: dict[str, Any] | None, unit: str, key: str, scale: float = 1.0, nd: int = 1) -> str:
    v = ((p or {}).get(unit) or {}).get(key)
    return fmt(None if v is None else v * scale, nd)


def _proxy_table(r: dict[str, Any]) -> list[str]:
    lines = ["", "thread pool per decoded token (single stream) | per decode step (batch); n/a: not counted",
             f"{'threads':>8}{'syncs':>8}{'inline':>8}{'wait us':>9}{'omp':>7}{'forkjoin':>9}{'sleeps':>8}  |"
             f"{'syncs':>8}{'wait us':>9}{'forkjoin':>9}"]
    for row in _rows(r):
        t, b = row["tokenmill"].get("proxy_tg"), row["tokenmill"].get("proxy_batch")
        lines.append(f"{row['threads']:>8}{_per(t, 'per_token', 'regions'):>8}{_per(t, 'per_token', 'inline'):>8}"
                     f"{_per(t, 'per_token', 'join_wait_ns', 1e-3):>9}{_per(t, 'per_token', 'omp_regions'):>7}"
                     f"{_per(t, 'per_token', 'gomp_fork_joins'):>9}{_per(t, 'per_token', 'worker_sleeps', nd=2):>8}  |"
                     f"{_per(b, 'per_step', 'regions'):>8}{_per(b, 'per_step', 'join_wait_ns', 1e-3):>9}"
                     f"{_per(b, 'per_step', 'gomp_fork_joins'):>9}")
    lines.append("  syncs: parallel regions the pool ran on more than one thread; inline: calls run on the "
                 "caller alone; omp: the core's OpenMP regions; forkjoin: every OpenMP region in the process "
                 f"(gomp shim: {r['gomp_shim']})")
    return lines


def _problems(r: dict[str, Any]) -> list[str]:
    out = []
    for row in _rows(r):
        tm, lc = row["tokenmill"], row["llama_cpp"]
        if tm.get("error"):
            out.append(f"  {row['threads']} threads, tokenmill: {tm['error']}")
        if tm.get("note"):
            out.append(f"  {row['threads']} threads, tokenmill: {tm['note']}")
        if len(tm.get("openmp_runtimes") or []) > 1:
            out.append(f"  {row['threads']} threads: several OpenMP runtimes loaded, fork-join counts may "
                       f"mislead: {', '.join(tm['openmp_runtimes'])}")
        out += [f"  {row['threads']} threads, llama.cpp: {e}" for e in lc.get("errors", [])]
    done = {row["threads"] for row in r["rows"]}
    missing = [n for n in r.get("thread_counts", []) if n not in done]
    if missing:
        out.append(f"  not measured (the run ended first): {', '.join(map(str, missing))} threads")
    return ["", "problems:", *out] if out else []


def report(r: dict[str, Any]) -> str:
    lines = _header(r)
    for test, key, title in METRICS:
        if test in r["tests"]:
            lines += _metric_table(r, test, key, title)
    lines += _proxy_table(r)
    lines += _problems(r)
    return "\n".join(lines)
