"""Context length and KV capacity through the HTTP APIs, on a tiny model (256-token context) served
with a KV cache of 128 tokens in 16-token blocks: prompts at the context's edge, a request larger
than the whole cache, requests that together overflow it (preemption), n > 1 near the limit, prefix
reuse to the token around block boundaries, and context shift with stop strings and structured output. Every refusal
is a 400 naming the sizes, and no test leaves a KV block in use (the fixture checks)."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_helpers import model_name, start_server, wait_idle
from test_errors import ollama_error, openai_error
from tiny_model import TinyLlamaSpec, write_tiny_llama

KV_TOKENS, BLOCK = 128, 16


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("ctx") / "tiny.gguf", TinyLlamaSpec())
    server, host = start_server(str(path), kv_size=KV_TOKENS, block_size=BLOCK)
    assert host.wait_ready(60), host.error
    yield server, host
    server.stop()


@pytest.fixture
def kv(kv_server):
    server, host = kv_server
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c, host
    wait_idle(host)


def ids(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 200) for _ in range(n)]


def texts(body: dict) -> list[str]:
    return [c["text"] for c in body["choices"]]


def test_the_context_reported_is_the_one_requests_get(kv):
    """A KV cache smaller than the model's context caps every sequence at the cache's size; /v1/models,
    /api/ps and /props said 256 while a 200-token prompt was refused as over 128."""
    c, host = kv
    assert host.current.engine.max_model_len == KV_TOKENS
    card = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == model_name(host))
    assert card["max_model_len"] == KV_TOKENS
    assert c.get("/api/ps").json()["models"][0]["context_length"] == KV_TOKENS
    assert c.get("/props").json()["default_generation_settings"]["n_ctx"] == KV_TOKENS


@pytest.mark.parametrize("path, field", [("/v1/completions", "max_tokens"), ("/completion", "n_predict")])
def test_prompts_at_one_under_and_over_the_context(kv, path, field):
    c, _ = kv
    body = {field: 8, "temperature": 0}
    for n, room in ((KV_TOKENS - 2, 2), (KV_TOKENS - 1, 1)):
        r = c.post(path, json={**body, "prompt": ids(n, n)})
        assert r.status_code == 200, r.text
        got = r.json()
        if path == "/completion":
            assert got["tokens_evaluated"] == n and got["tokens_predicted"] == room and got["stop_type"] == "limit"
        else:
            assert got["usage"]["completion_tokens"] == room and got["choices"][0]["finish_reason"] == "length"
    for n, tail in ((KV_TOKENS, ", with no room left to generate"), (KV_TOKENS + 1, ""), (300, "")):
        r = c.post(path, json={**body, "prompt": ids(n, n)})
        msg = openai_error(r, 400)["message"] if path.startswith("/v1") else ollama_error(r, 400)
        assert msg == f"prompt is {n} tokens, but the context holds {KV_TOKENS}{tail}"


def test_ollama_at_the_context_truncates_or_refuses(kv):
    c, host = kv
    tok = host.current.engine.tokenizer
    prompt = "Q" * KV_TOKENS
    assert len(tok.encode(prompt)) == KV_TOKENS
    base = {"model": model_name(host), "raw": True, "stream": False, "options": {"temperature": 0, "num_predict": 4}}
    # One token short of the context: it fits as it is, and generation shifts past the end.
    r = c.post("/api/generate", json={**base, "prompt": prompt[:-1], "truncate": False})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == KV_TOKENS - 1 and r.json()["eval_count"] == 4
    msg = ollama_error(c.post("/api/generate", json={**base, "prompt": prompt, "truncate": False}), 400)
    assert msg == f"prompt is {KV_TOKENS} tokens, but the context holds {KV_TOKENS}, with no room left to generate"
    # num_ctx over the cache (and the model's trained context) is capped at the cache.
    msg = ollama_error(c.post("/api/generate", json={**base, "prompt": prompt + "Q", "truncate": False,
                                                      "options": {"num_ctx": 4096}}), 400)
    assert msg == f"prompt is {KV_TOKENS + 1} tokens, but the context holds {KV_TOKENS}"
    r = c.post("/api/generate", json={**base, "prompt": prompt * 2, "options": {"num_ctx": 4096, "num_predict": 4}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == KV_TOKENS - 4


def test_n_samples_that_overflow_the_cache_report_no_false_cache_hits(kv):
    """4 samples of a 100-token prompt, each growing to 127 tokens, need more blocks than the cache
    has: samples are preempted and recomputed. The recompute found the request's own blocks cached,
    and usage said the whole fresh prompt had been a prefix-cache hit (cached_tokens == prompt_tokens)."""
    c, host = kv
    engine = host.current.engine
    before = engine.stats.num_preemptions
    prompt = ids(7, 100)
    many = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "n": 4, "temperature": 0})
    assert many.status_code == 200, many.text
    assert engine.stats.num_preemptions > before
    body = many.json()
    assert [ch["finish_reason"] for ch in body["choices"]] == ["length"] * 4
    assert body["usage"]["completion_tokens"] == 4 * (KV_TOKENS - 100)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    alone = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0}).json()
    assert texts(body) == texts(alone) * 4
    # Now the prompt is cached, all but its last token: 6 full blocks, and 3 tokens of a 7th that the
    # samples' blocks begin with.
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 99


def test_concurrent_requests_over_the_cache_match_running_alone(kv):
    c, _ = kv
    bodies = [{"prompt": ids(20 + i, 40 + 7 * i), "max_tokens": 60, "temperature": 0} for i in range(4)]
    chat = [{"messages": [{"role": "user", "content": "x y z " * (5 + i)}], "max_tokens": 60,
             "temperature": 0} for i in range(2)]
    jobs = [("/v1/completions", b) for b in bodies] + [("/v1/chat/completions", b) for b in chat]

    def post(job):
        r = c.post(*job[:1], json=job[1])
        assert r.status_code == 200, r.text
        return r.json()

    alone = [post(j) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(post, jobs))
    for a, t in zip(alone, together):
        assert [ch.get("text", ch.get("message")) for ch in a["choices"]] == \
               [ch.get("text", ch.get("message")) for ch in t["choices"]]


def test_ollama_shifting_requests_over_the_cache_match_running_alone(kv):
    c, host = kv
    prompts = [f"{i} " + "x y z w " * (8 + 4 * i) for i in range(4)]

    def gen(prompt):
        r = c.post("/api/generate", json={"model": model_name(host), "prompt": prompt, "raw": True, "stream": False,
                                          "options": {"temperature": 0, "num_predict": 150, "num_keep": 12}})
        assert r.status_code == 200, r.text
        return r.json()

    alone = [gen(p) for p in prompts]
    assert all(a["eval_count"] == 150 and a["prompt_eval_count"] + 150 > KV_TOKENS for a in alone)  # shifted
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(gen, prompts))
    assert [t["response"] for t in together] == [a["response"] for a in alone]


@pytest.mark.parametrize("n", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1])
def test_prefix_reuse_at_block_boundaries(kv, n):
    """A repeated prompt takes all but its last token from the cache (that one's logits must be
    computed): its full blocks, and the first tokens of the block after them, which the cached
    block holding them gives by copy; and answers the same. A longer prompt takes all of it."""
    c, _ = kv
    prompt = ids(100 + n, n)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    first, again = (c.post("/v1/completions", json=body).json() for _ in range(2))
    longer = c.post("/v1/completions", json={**body, "prompt": prompt + [5]}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert texts(first) == texts(again)


def test_context_shift_with_a_stop_string_after_the_shift(kv):
    c, host = kv
    tok = host.current.engine.tokenizer
    num_ctx, prompt = 24, "QQQQ"
    body = {"model": model_name(host), "prompt": prompt, "raw": True, "stream": False}
    options = {"temperature": 1, "seed": 3, "num_predict": 60, "num_ctx": num_ctx}
    full = c.post("/api/generate", json={**body, "options": options}).json()
    text, out = full["response"], full["context"][len(prompt):]
    shifted_at = len(tok.decode(out[:num_ctx - len(prompt)]))  # the text written before the first shift
    start = next(i for i in range(shifted_at, len(text) - 2)
                 if text[i:i + 2].isalnum() and text.find(text[i:i + 2]) == i)
    stop = text[start:start + 2]
    stopped = c.post("/api/generate", json={**body, "options": {**options, "stop": [stop]}}).json()
    assert stopped["done_reason"] == "stop" and stopped["response"] == text[:start]
    streamed = c.post("/api/generate", json={**body, "stream": True, "options": {**options, "stop": [stop]}})
    lines = [json.loads(line) for line in streamed.text.splitlines() if line]
    assert lines[-1]["done_reason"] == "stop" and "".join(x["response"] for x in lines) == text[:start]


def test_structured_output_survives_a_context_shift(kv):
    c, host = kv
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
                                                                              "items": {"type": "integer"}}},
              "required": ["a", "b"]}
    r = c.post("/api/generate", json={"model": model_name(host), "prompt": "QQQQ", "raw": True, "stream": False,
                                      "format": schema, "options": {"temperature": 1, "seed": 0, "num_predict": 60,
                                                                    "num_ctx": 24}})
    body = r.json()
    assert r.status_code == 200 and body["eval_count"] > 20  # past the first shift (20 tokens of room)
    assert body["done_reason"] == "stop"
    value = json.loads(body["response"])
    assert isinstance(value["a"], int) and all(isinstance(x, int) for x in value["b"])
