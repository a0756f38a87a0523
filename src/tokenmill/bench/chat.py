"""A multi-turn chat as chat clients send one: each turn the whole conversation so far (system prompt,
earlier questions and the model's own replies) through the model's chat template, a greedy reply that
ends at the model's end token. Per turn: the prompt tokens, how many of them each side computed (the
rest it took from its cache) and the time to the first new token; tokenmill (its prefix cache, to
the token) next to llama.cpp through llama-cpp-python, whose context keeps the last sequence and
reuses its longest common prefix with the next (as llama-server's slot and llama-cpp-python's own
`generate` do). Each side builds the conversation from its own replies; a fresh engine and a cleared
llama.cpp context start every repeat, and the figures are medians over the repeats.

    tokenmill bench chat [--model smollm2 --turns 8 --max-tokens 32 --repeats 3 --threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.common import environment, fmt, loadavg, progress, ratio, set_threads, write_json

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two cities is larger?",
             "Name a famous museum in each.", "What language do they speak there?", "Thanks. One more: Spain?",
             "Summarise our chat in one line.", "Is Madrid far from Paris?", "How would I travel between them?",
             "What should I pack?", "Which season is best for the trip?", "Thank you, that is all."]


@dataclass
class Turn:
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the side computed, not taken from its cache
    ttft_s: float
    reply: list[int]


class TokenmillChat:
    """The engine in this process, a fresh one (and so an empty cache) per conversation."""

    def __init__(self, path: str, max_tokens: int):
        from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams

        self.engine = LLMEngine.from_path(path, EngineConfig())
        # Room for any sensible chat (llama.cpp allocates its KV cache for all of it).
        self.context = min(self.engine.max_model_len, 8192)
        self.max_tokens = max_tokens
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0)
        self.stop_ids = sorted(self.engine.scheduler.stop_ids)

    def turn(self, ids: list[int]) -> Turn:
        t0 = time.perf_counter()
        self.engine.add_request(ids, self.params)
        ttft, cached, reply = None, 0, []
        while self.engine.has_unfinished():
            for ev in self.engine.step():
                if ttft is None and ev.token_ids:
                    ttft, cached = time.perf_counter() - t0, ev.num_cached_tokens
                reply += ev.token_ids
        return Turn(len(ids), len(ids) - cached, ttft or 0.0, reply)


class LlamaCppChat:
    def __init__(self, path: str, threads: int, max_tokens: int, stop_ids: list[int], context: int):
        from tokenmill.bench.llama_cpp_peer import LlamaCppModel

        self.context = context  # tokenmill's, so both sides hold the same conversations
        self.model = LlamaCppModel(path, threads=threads, n_ctx=context)
        self.max_tokens, self.stop_ids = max_tokens, stop_ids

    def new_conversation(self) -> None:
        self.model.llm.reset()

    def turn(self, ids: list[int]) -> Turn:
        run, reused = self.model.greedy_continuing(ids, self.max_tokens, self.stop_ids)
        return Turn(len(ids), len(ids) - reused, run.token_times[0] - run.t0, run.token_ids)


def converse(side, tokenizer, turns: int) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in (QUESTIONS * (turns // len(QUESTIONS) + 1))[:turns]:
        messages.append({"role": "user", "content": question})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        if len(ids) + side.max_tokens > side.context:
            raise SystemExit(f"turn {len(out) + 1}: the conversation ({len(ids)} tokens and a reply of up to "
                             f"{side.max_tokens}) outgrows the {side.context}-token context; ask for fewer --turns")
        turn = side.turn(ids)
        out.append(turn)
        messages.append({"role": "assistant", "content": tokenizer.decode(turn.reply, skip_special_tokens=True).strip()})
    return out


def summarise(runs: list[list[Turn]]) -> dict[str, Any]:
    """Medians per turn over the repeats (token counts from the first repeat: greedy, they repeat)."""
    per_turn = [{"prompt_tokens": runs[0][i].prompt_tokens, "computed_tokens": runs[0][i].computed_tokens,
                 "ttft_ms": 1e3 * statistics.median(r[i].ttft_s for r in runs),
                 "ttft_ms_runs": [1e3 * r[i].ttft_s for r in runs]} for i in range(len(runs[0]))]
    later = per_turn[1:]
    return {"turns": per_turn, "later_turns": {
        "prompt_tokens": sum(t["prompt_tokens"] for t in later),
        "computed_tokens": sum(t["computed_tokens"] for t in later),
        "ttft_ms": sum(t["ttft_ms"] for t in later)},
        "replies": [t.reply for t in runs[0]]}


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="installed model name or .gguf path (it needs a chat template)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens a reply has (default 32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="both sides' threads (default: tokenmill's default)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="tokenmill alone")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import cpu_threads
    from tokenmill.gguf import open_gguf
    from tokenmill.store import resolve_model
    from tokenmill.tokenizer import Tokenizer

    if args.turns < 2 or args.repeats < 1 or args.max_tokens < 1:
        raise SystemExit("--turns must be at least 2 (the first turn has nothing to reuse), --repeats and "
                         "--max-tokens at least 1")
    set_threads(args.threads)
    path = str(resolve_model(args.model))
    tokenizer = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    tokenizer.apply_chat_template([{"role": "user", "content": "x"}])  # no template: the error, before any run
    env = environment()
    result: dict[str, Any] = {"benchmark": "chat", "model": path, "env": env, "loadavg_start": loadavg(),
                              "config": {"turns": args.turns, "max_tokens": args.max_tokens, "repeats": args.repeats}}
    tm_runs, lc_runs = [], []
    llama = None
    for k in range(args.repeats):
        progress(f"tokenmill conversation {k + 1}/{args.repeats}")
        side = TokenmillChat(path, args.max_tokens)
        tm_runs.append(converse(side, tokenizer, args.turns))
        if not args.skip_llama_cpp:
            if llama is None:
                from tokenmill.bench.llama_cpp_peer import LlamaCppMissing, describe

                try:
                    env["llama_cpp"] = describe()
                except LlamaCppMissing as exc:
                    raise SystemExit(str(exc)) from None
                threads = args.threads or cpu_threads.current_threads().count  # the engine's, applied by now
                llama = LlamaCppChat(path, threads, args.max_tokens, side.stop_ids, side.context)
            progress(f"llama.cpp conversation {k + 1}/{args.repeats}")
            llama.new_conversation()
            lc_runs.append(converse(llama, tokenizer, args.turns))
    if llama is not None:
        llama.model.close()
    result["tokenmill"] = summarise(tm_runs)
    result["llama_cpp"] = summarise(lc_runs) if lc_runs else None
    if lc_runs:
        a, b = result["tokenmill"], result["llama_cpp"]
        result["ratio_llama_cpp_over_tokenmill_ttft"] = {
            "later_turns": ratio(b["later_turns"]["ttft_ms"], a["later_turns"]["ttft_ms"]),
            "per_turn": [ratio(y["ttft_ms"], x["ttft_ms"]) for x, y in zip(a["turns"], b["turns"])]}
        result["same_replies"] = sum(x == y for x, y in zip(a["replies"], b["replies"]))
    result["loadavg_end"] = loadavg()
    return result


def report(r: dict[str, Any]) -> str:
    c, tm, lc = r["config"], r["tokenmill"], r["llama_cpp"]
    lines = [f"chat: {c['turns']} turns, each the whole conversation so far; greedy replies of at most "
             f"{c['max_tokens']} tokens, ending at the end token; medians of {c['repeats']} conversations",
             f"model {r['model']}; threads {r['env']['threads']}; cpu flags {r['env']['cpu_flags']}", ""]
    head = f"{'turn':>4}{'prompt':>8}{'computed':>10}{'TTFT ms':>9}"
    lines.append(head + (f"  | llama.cpp{'prompt':>8}{'computed':>10}{'TTFT ms':>9}{'ratio':>7}" if lc else ""))
    for i, t in enumerate(tm["turns"]):
        row = f"{i + 1:>4}{t['prompt_tokens']:>8}{t['computed_tokens']:>10}{t['ttft_ms']:>9.1f}"
        if lc:
            u = lc["turns"][i]
            row += (f"  | {'':9}{u['prompt_tokens']:>8}{u['computed_tokens']:>10}{u['ttft_ms']:>9.1f}"
                    f"{fmt(r['ratio_llama_cpp_over_tokenmill_ttft']['per_turn'][i], 2):>7}")
        lines.append(row)
    a = tm["later_turns"]
    lines.append(f"turns 2..{c['turns']}: tokenmill computed {a['computed_tokens']} of {a['prompt_tokens']} prompt "
                 f"tokens, TTFT {a['ttft_ms']:.1f} ms in all")
    if lc:
        b = lc["later_turns"]
        lines.append(f"turns 2..{c['turns']}: llama.cpp computed {b['computed_tokens']} of {b['prompt_tokens']}, "
                     f"TTFT {b['ttft_ms']:.1f} ms in all: llama.cpp / tokenmill "
                     f"{fmt(r['ratio_llama_cpp_over_tokenmill_ttft']['later_turns'], 2)}; "
                     f"replies the same in {r['same_replies']} of {c['turns']} turns")
    lines.append(f"loadavg {r['loadavg_start']} -> {r['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "tokenmill bench chat") -> int:
    args = build_parser(prog).parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    write_json(args.json, result)
    return 0
