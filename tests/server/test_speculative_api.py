"""Speculative decoding through the HTTP APIs, on a tiny model with GGUF weights (the native,
batch-invariant path where the engine speculates): the per-request switches, their errors, stop strings
cutting a run of accepted tokens, and the /metrics counters."""
from __future__ import annotations

import gguf
import httpx
import pytest

from server_helpers import model_name, start_server, start_speculative_server, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.engine.output import OutputAssembler
from tokenmill.engine import SamplingParams
from tokenmill.kernels import variant
from tokenmill.server import ollama_params, openai_params

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

PROMPT = list(range(40, 52)) * 5  # token ids that repeat: proposals from the first step on


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live, host = start_speculative_server(tmp_path_factory.mktemp("specapi"))
    yield live.url, host
    live.stop()


def complete(c, host, **body):
    r = c.post("/v1/completions", json={"model": model_name(host), "prompt": PROMPT, "max_tokens": 40,
                                        "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_same_answer_on_and_off_and_counted_in_metrics(server):
    url, host = server
    with httpx.Client(base_url=url, timeout=60) as c:
        off = complete(c, host, speculative=False)
        before = _spec_metrics(c)
        on = complete(c, host)
        after = _spec_metrics(c)
        ollama = c.post("/api/generate", json={"model": model_name(host), "prompt": "ab" * 30, "raw": True,
                                               "stream": False, "options": {"temperature": 0, "num_predict": 20,
                                                                            "speculative": False}}).json()
        ollama_on = c.post("/api/generate", json={"model": model_name(host), "prompt": "ab" * 30, "raw": True,
                                                  "stream": False, "options": {"temperature": 0, "num_predict": 20,
                                                                               "num_speculative_tokens": 3}}).json()
    wait_idle(host)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    # The same counts, but for the cache: the second request takes all but the prompt's last token
    # from the first one's blocks (the 60 tokens are less than one block, a prefix that ends inside it).
    cached = [r["usage"].pop("prompt_tokens_details")["cached_tokens"] for r in (off, on)]
    assert on["usage"] == off["usage"] and cached == [0, len(PROMPT) - 1]
    assert ollama["response"] == ollama_on["response"]
    assert after["drafts"] > before["drafts"]
    assert after["accepted"] > before["accepted"] and after["draft_tokens"] >= after["accepted"]


def _spec_metrics(c) -> dict[str, float]:
    text = c.get("/metrics").text
    names = {"drafts": "tokenmill:spec_decode_num_drafts_total", "draft_tokens":
             "tokenmill:spec_decode_num_draft_tokens_total", "accepted": "tokenmill:spec_decode_num_accepted_tokens_total"}
    out = {}
    for key, name in names.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " "))
        out[key] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_stop_string_cuts_a_run_of_accepted_tokens_as_without_speculation(server):
    url, host = server
    with httpx.Client(base_url=url, timeout=60) as c:
        full = complete(c, host, speculative=False)["choices"][0]["text"]
        stop = full[len(full) // 2:len(full) // 2 + 2]
        answers = [complete(c, host, stop=[stop], speculative=s) for s in (False, True)]
    wait_idle(host)
    assert answers[0]["choices"][0] == answers[1]["choices"][0]
    assert answers[0]["choices"][0]["finish_reason"] == "stop"
    assert answers[0]["usage"] == answers[1]["usage"]


@pytest.mark.parametrize("body,field", [({"speculative": "yes"}, "speculative"),
                                        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
                                        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
                                        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens")])
def test_bad_values_are_400s_naming_the_field(server, body, field):
    url, host = server
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": model_name(host), "messages": [{"role": "user",
                                                                                        "content": "hi"}], **body})
        o = c.post("/api/generate", json={"model": model_name(host), "prompt": "hi", "options": body})
    assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert o.status_code == 400 and f"options.{field}" in o.json()["error"]


def test_parsed_into_sampling_params():
    p = openai_params.parse_options({"speculative": False, "num_speculative_tokens": 3}, chat=True).params
    assert (p.speculative, p.num_speculative_tokens) == (False, 3)
    p = openai_params.parse_options({}, chat=False).params
    assert (p.speculative, p.num_speculative_tokens) == (None, None)
    p = ollama_params.parse_options({"options": {"speculative": True, "num_speculative_tokens": 0}}, "/api/chat").params
    assert (p.speculative, p.num_speculative_tokens) == (True, 0)


def test_usage_counts_tokens_up_to_the_stop_string_when_one_event_brings_more(tiny_tokenizer):
    from tokenmill.engine.engine import TokenEvent

    ids = tiny_tokenizer.encode("hello there, general", add_special_tokens=False)
    out = OutputAssembler(tiny_tokenizer, SamplingParams(stop=["there"]))
    delta = out.push(TokenEvent("r", ids, None, None, None, None, 3, 0, len(ids)))
    assert delta.hit_stop_string and delta.text == "hello "
    upto = next(i for i in range(len(ids) + 1) if "there" in tiny_tokenizer.decode(ids[:i]))
    assert delta.num_output_tokens == upto < len(ids)


def test_a_memory_budget_counts_the_draft_models_weights_and_cache(tmp_path):
    # With --max-memory the KV cache is cut to what the budget leaves after the weights: with a draft
    # model, after both models' weights, and each token slot costs the draft's K/V beside the model's
    # (the draft has as many slots as the model).
    from tokenmill.engine import EngineConfig
    from tokenmill.engine.memory import engine_bytes, kv_bytes_per_token
    from tokenmill.model import load_model
    from tokenmill.server.model_loads import MemoryPool

    spec = TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=4096)
    target = write_tiny_llama(tmp_path / "t.gguf", spec)
    draft = write_tiny_llama(tmp_path / "d.gguf", TinyLlamaSpec(n_layers=1, weight_type=spec.weight_type,
                                                                context_length=4096, seed=3))
    need = MemoryPool().load_bytes(str(target), str(draft))
    assert need == int((target.stat().st_size + draft.stat().st_size) * 1.1)
    cfg, loaded = EngineConfig(dtype="gguf"), load_model(target, "gguf")
    per_token = kv_bytes_per_token(cfg, loaded, load_model(draft, "gguf"))
    assert per_token > kv_bytes_per_token(cfg, loaded)
    budget = need + 1500 * per_token  # room for 1,500 slots of the two caches, not 4,096
    live, host = start_server(str(target), dtype="gguf", speculative=f"draft:{draft}", kv_size=4096,
                              max_memory_gb=budget / 1e9)
    try:
        assert host.wait_ready(60), host.error
        engine = host.current.engine
        block = engine.cfg.block_size
        assert engine.cfg.max_total_tokens == (budget - need) // per_token // block * block < 4096
        proposer = engine.scheduler.speculator.proposer
        assert proposer.draft.kv.num_blocks == engine.cfg.num_blocks
        # the two caches fit what the budget left after the weights; both count in the engine's size
        assert engine.kv.nbytes + proposer.draft.kv.nbytes <= budget - need
        assert engine_bytes(engine) >= engine.kv.nbytes + proposer.draft.kv.nbytes + draft.stat().st_size
        with httpx.Client(base_url=live.url, timeout=60) as c:
            assert complete(c, host)["choices"][0]["text"]
    finally:
        live.stop()


def test_a_server_with_a_draft_model_answers_as_without_one(tmp_path):
    # `serve --speculative draft:MODEL`: the draft (another tiny model with the same vocabulary) loads with
    # the model; answers are the model's own, and the draft's cache is empty when the server is idle.
    spec = TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=512)
    target = write_tiny_llama(tmp_path / "t.gguf", spec)
    draft = write_tiny_llama(tmp_path / "d.gguf", TinyLlamaSpec(n_layers=1, weight_type=spec.weight_type,
                                                                context_length=512, seed=3))
    live, host = start_server(str(target), dtype="gguf", speculative=f"draft:{draft}")
    try:
        assert host.wait_ready(60), host.error
        with httpx.Client(base_url=live.url, timeout=60) as c:
            on, off = complete(c, host), complete(c, host, speculative=False)
        wait_idle(host)
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        proposer = host.current.engine.scheduler.speculator.proposer
        assert type(proposer).__name__ == "DraftProposer" and proposer.draft.blocks.num_used_blocks == 0
    finally:
        live.stop()
