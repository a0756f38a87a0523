"""llama.cpp's own benchmark binaries as a peer: `llama-bench` (tg/pp figures, `-o json`) and
`llama-batched-bench` (many sequences decoding at once: the S_TG column of its table), run as
subprocesses with a timeout and parsed.

Both binaries time their own loops and run no sampler (batched-bench feeds random tokens), so their
figures are llama.cpp's compute alone; tokenmill's include its greedy sampling and engine step."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import Any


class ToolError(RuntimeError):
    """A binary failed, timed out, or printed nothing this parser understands."""


# --- llama-bench -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchFigure:
    n_threads: int
    n_prompt: int
    n_gen: int
    avg_ts: float     # tokens/s, mean over the repetitions
    stddev_ts: float

    @property
    def test(self) -> str:
        """llama-bench's own name for the test: pp512, tg128, or pp512+tg128."""
        if self.n_prompt and self.n_gen:
            return f"pp{self.n_prompt}+tg{self.n_gen}"
        return f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"


def parse_llama_bench_json(text: str) -> list[BenchFigure]:
    """llama-bench `-o json` (a JSON array of tests) or `-o jsonl` (one object per line)."""
    text = text.strip()
    start = text.find("[")
    try:
        rows = json.loads(text[start:]) if start >= 0 and text[start:].rstrip().endswith("]") else \
            [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    except json.JSONDecodeError as exc:
        raise ToolError(f"llama-bench printed no JSON this parser reads ({exc})") from None
    out = []
    for row in rows:
        try:
            out.append(BenchFigure(int(row["n_threads"]), int(row["n_prompt"]), int(row["n_gen"]),
                                   float(row["avg_ts"]), float(row.get("stddev_ts", 0.0))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolError(f"llama-bench JSON row without {exc}") from None
    if not out:
        raise ToolError("llama-bench printed no results")
    return out


def llama_bench_command(binary: str, model: str, threads: int, pp_tokens: int, tg_tokens: int,
                        repeats: int) -> list[str]:
    return [binary, "-m", model, "-t", str(threads), "-p", str(pp_tokens), "-n", str(tg_tokens),
            "-r", str(repeats), "-o", "json"]


def run_llama_bench(binary: str, model: str, threads: int, pp_tokens: int, tg_tokens: int, repeats: int,
                    timeout: float) -> dict[str, Any]:
    """{"tg_tok_s", "pp_tok_s", "command", "figures"} for one thread count."""
    cmd = llama_bench_command(binary, model, threads, pp_tokens, tg_tokens, repeats)
    figures = parse_llama_bench_json(_run(cmd, timeout))
    by_test = {f.test: f for f in figures if f.n_threads == threads}
    tg, pp = by_test.get(f"tg{tg_tokens}"), by_test.get(f"pp{pp_tokens}")
    return {"tg_tok_s": tg.avg_ts if tg else None, "pp_tok_s": pp.avg_ts if pp else None,
            "tg_stddev": tg.stddev_ts if tg else None, "pp_stddev": pp.stddev_ts if pp else None,
            "command": " ".join(cmd), "source": "llama-bench"}


# --- llama-batched-bench ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchedFigure:
    pp: int       # prompt tokens per sequence
    tg: int       # generated tokens per sequence
    pl: int       # sequences decoding at once
    s_pp: float   # prompt tokens/s over all sequences
    s_tg: float   # generated tokens/s over all sequences (one decode step = pl tokens)


_ROW = re.compile(r"^\|\s*\d+\s*\|")


def parse_batched_bench(text: str) -> list[BatchedFigure]:
    """llama-batched-bench's results: its markdown table (| PP | TG | B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s |, columns found by their headers) or `--output-format jsonl`."""
    out: list[BatchedFigure] = []
    columns: dict[str, int] | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            try:
                r = json.loads(line)
                out.append(BatchedFigure(int(r["pp"]), int(r["tg"]), int(r["pl"]), float(r["speed_pp"]),
                                         float(r["speed_tg"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        elif line.startswith("|") and "S_TG" in line:
            names = [c.strip() for c in line.strip("|").split("|")]
            columns = {name: i for i, name in enumerate(names)}
        elif columns and _ROW.match(line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            try:
                out.append(BatchedFigure(int(cells[columns["PP"]]), int(cells[columns["TG"]]),
                                         int(cells[columns["B"]]), float(cells[columns["S_PP t/s"]]),
                                         float(cells[columns["S_TG t/s"]])))
            except (KeyError, IndexError, ValueError):
                continue
    if not out:
        raise ToolError("llama-batched-bench printed no result rows (is -c at least B*(PP+TG)?)")
    return out


def batched_bench_command(binary: str, model: str, threads: int, num_seqs: int, prompt_len: int,
                          gen_tokens: int) -> list[str]:
    # It skips a row silently when B*(PP+TG) exceeds the context, and each of the B sequences gets
    # n_ctx / B cells: a multiple of B, each sequence's share rounded up to 256.
    n_ctx = num_seqs * (-(-(prompt_len + gen_tokens) // 256) * 256)
    return [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-b", "2048",
            "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_tokens), "-npl", str(num_seqs)]


def run_batched_bench(binary: str, model: str, threads: int, num_seqs: int, prompt_len: int, gen_tokens: int,
                      timeout: float) -> dict[str, Any]:
    """{"batch_tok_s" (S_TG), "batch_prefill_tok_s" (S_PP), "command"} for one thread count."""
    cmd = batched_bench_command(binary, model, threads, num_seqs, prompt_len, gen_tokens)
    rows = [r for r in parse_batched_bench(_run(cmd, timeout)) if r.pl == num_seqs]
    if not rows:
        raise ToolError(f"llama-batched-bench printed no row for {num_seqs} sequences")
    return {"batch_tok_s": rows[0].s_tg, "batch_prefill_tok_s": rows[0].s_pp, "command": " ".join(cmd),
            "source": "llama-batched-bench"}


def _run(cmd: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        raise ToolError(f"{cmd[0]} timed out after {timeout:.0f} s") from None
    except OSError as exc:
        raise ToolError(f"{cmd[0]} could not start: {exc}") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ToolError(f"{cmd[0]} exited with {done.returncode}: {tail}")
    return done.stdout + "\n" + done.stderr  # the table goes to the log, stdout or stderr by version
