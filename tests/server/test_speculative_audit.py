"""Speculative decoding with the rest of the HTTP APIs, on a tiny GGUF model whose greedy output loops
(prompt lookup proposes, and most proposals are accepted): streamed answers with stop strings, logprobs
and parallel samples are those without speculation; a client leaving mid-stream while verifications run
leaves nothing behind; a short context ends where it would without speculation."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest

from server_helpers import model_name, start_speculative_server, wait_idle
from tokenmill.kernels import variant

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

# Prompts whose greedy continuations change token midway (several distinct tokens, some of them bytes
# of multi-byte characters), found by trying seeds on this model.
PROMPTS = [[130, 225, 213, 66, 129, 124, 129, 257, 129, 251, 4, 84] * 4, list(range(40, 52)) * 4]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live, host = start_speculative_server(tmp_path_factory.mktemp("specaudit"))
    # Propose at every match (rows cost next to nothing here): the tests exercise verification.
    spec = host.current.engine.scheduler.speculator
    spec.cfg = spec.proposer.cfg = replace(spec.cfg, row_cost=1e-4, learn_step_costs=False)
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client, host
    live.stop()


def accepted(host) -> int:
    return host.current.engine.stats.spec.num_accepted_tokens


def sse(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def joined(chunks: list[dict]) -> tuple[dict, dict, dict, dict | None]:
    """Per choice index: text, (token, logprob) pairs, finish reason; and the usage."""
    text, lps, reasons, usage = {}, {}, {}, None
    for ch in chunks:
        usage = ch.get("usage") or usage
        for choice in ch["choices"]:
            i = choice["index"]
            text[i] = text.get(i, "") + choice["text"]
            if choice["logprobs"]:
                lp = choice["logprobs"]
                lps.setdefault(i, []).extend(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
            reasons[i] = choice["finish_reason"] or reasons.get(i)
    return text, lps, reasons, usage


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completions_with_stop_strings_logprobs_and_n_are_those_without_speculation(server, prompt):
    c, host = server
    base = {"model": model_name(host), "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = c.post("/v1/completions", json={**base, "speculative": False}).json()["choices"][0]["text"]
    # A stop string of three characters from the middle: it spans tokens and completes inside a run of
    # accepted proposals; and one that never completes, whose start is held back until the end.
    for stop in ([full[20:23]], [full[-2:] + "\n"]):
        body = {**base, "stop": stop, "n": 2, "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}
        before = accepted(host)
        on = joined(sse(c, "/v1/completions", body))
        assert accepted(host) > before
        off = joined(sse(c, "/v1/completions", {**body, "speculative": False}))
        assert on == off
        text, lps, reasons, usage = on
        assert text[0] == text[1] and len(lps[0]) == usage["completion_tokens"] // 2
        assert reasons[0] == ("stop" if stop[0] in full else "length")
    wait_idle(host)


def test_seeded_ollama_chat_with_its_default_sampling_is_the_same_with_and_without(server):
    # Ollama's default truncation (top_k 40, top_p 0.9) with a seed, a low temperature and a penalty over
    # the last 64 tokens (the tiny model's flat logits repeat little at the defaults): every accepted row
    # drew as the step without speculation would have, its penalty window holding the proposals before it.
    c, host = server
    msgs = [{"role": "user", "content": "".join(map(chr, PROMPTS[0]))}]

    def chat(speculative: bool) -> tuple[str, dict]:
        with c.stream("POST", "/api/chat", json={"model": model_name(host), "messages": msgs, "options": {
                "seed": 11, "temperature": 0.2, "repeat_penalty": 1.05, "num_predict": 48,
                "speculative": speculative}}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        return "".join(ln["message"]["content"] for ln in lines), lines[-1]

    before = accepted(host)
    on, on_end = chat(True)
    assert accepted(host) > before
    assert on == chat(True)[0]  # reproducible with speculation on
    off, off_end = chat(False)
    assert on == off
    assert (on_end["eval_count"], on_end["prompt_eval_count"], on_end["done_reason"]) == \
           (off_end["eval_count"], off_end["prompt_eval_count"], off_end["done_reason"])
    wait_idle(host)


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
def test_a_client_gone_while_verifications_run_leaves_no_blocks_behind(server, path):
    c, host = server
    engine = host.current.engine
    # Each verifying step is slow, so the client leaves while one is in flight.
    engine.step_hook = lambda batch: time.sleep(0.02) if any(ch.draft_ids for ch in batch.chunks) else None
    try:
        body = {"model": model_name(host), "stream": True}
        body |= ({"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "n": 2}
                 if path == "/v1/completions" else
                 {"prompt": "ab" * 20, "raw": True, "options": {"temperature": 0, "num_predict": 400}})
        before = accepted(host)
        with httpx.Client(base_url=str(c.base_url), timeout=60) as leaving:
            with leaving.stream("POST", path, json=body) as r:
                for n, _ in enumerate(line for line in r.iter_lines() if line):
                    if n == 4:
                        break
        wait_idle(host)
        assert accepted(host) > before
    finally:
        engine.step_hook = None
    assert c.get("/health").status_code == 200
    r = c.post("/v1/completions", json={"model": model_name(host), "prompt": PROMPTS[1], "max_tokens": 5,
                                        "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("options", [{"num_ctx": 52, "num_predict": -2}, {"num_ctx": 52, "num_predict": 100},
                                     {"num_ctx": 60, "num_predict": 100}])
def test_a_short_context_ends_or_shifts_as_without_speculation(server, options):
    # The prompt leaves a few tokens of a small num_ctx: proposals stop at the context's end; with
    # num_predict -2 the answer ends there with `length`, else the context shifts and generation goes on.
    c, host = server

    def generate(speculative: bool) -> dict:
        r = c.post("/api/generate", json={"model": model_name(host), "prompt": "".join(map(chr, PROMPTS[1])),
                                          "raw": True, "stream": False,
                                          "options": {"temperature": 0, **options, "speculative": speculative}})
        assert r.status_code == 200, r.text
        return {k: r.json()[k] for k in ("response", "done_reason", "eval_count", "prompt_eval_count", "context")}

    before = accepted(host)
    on = generate(True)
    assert accepted(host) > before
    assert on == generate(False)
    assert on["done_reason"] == "length"
    assert on["eval_count"] == (options["num_ctx"] - on["prompt_eval_count"] if options["num_predict"] == -2
                                else options["num_predict"])
    wait_idle(host)
