"""The llama-server style endpoints: /completion (streaming and not), /embedding, /tokenize,
/detokenize, and the Prometheus /metrics names."""
from __future__ import annotations

import json
import time
import re

from server_helpers import model_name


def test_completion_non_streaming(client):
    r = client.post("/completion", json={"prompt": "hello", "n_predict": 4, "temperature": 0, "n_probs": 2})
    body = r.json()
    assert r.status_code == 200 and body["stop"] is True
    assert body["tokens_predicted"] == len(body["tokens"]) == 4 and body["stop_type"] == "limit"
    assert body["tokens_evaluated"] > 0 and body["timings"]["predicted_n"] == 4
    assert [len(p["top_logprobs"]) for p in body["completion_probabilities"]] == [2] * 4


def test_completion_streaming_matches(client):
    full = client.post("/completion", json={"prompt": [10, 11, 12], "n_predict": 5, "temperature": 0}).json()
    r = client.post("/completion", json={"prompt": [10, 11, 12], "n_predict": 5, "temperature": 0, "stream": True})
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
    assert "".join(e["content"] for e in events) == full["content"]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 5
    assert sum(len(e.get("tokens", [])) for e in events) == 5


def test_completion_n_predict_0_evaluates_the_prompt_into_the_cache_and_generates_nothing(client):
    # llama-server's cache warm-up (editor plugins send it ahead of the request that will follow).
    prompt = [10 + i % 50 for i in range(200)]
    body = client.post("/completion", json={"prompt": prompt, "n_predict": 0, "temperature": 0}).json()
    assert body["content"] == "" and body["tokens"] == [] and body["tokens_predicted"] == 0, body
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_evaluated"] == len(prompt)
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 0, "stream": True})
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
    assert len(events) == 1 and events[0]["content"] == "" and events[0]["tokens_predicted"] == 0, events
    after = client.post("/completion", json={"prompt": prompt + [7], "n_predict": 3, "temperature": 0}).json()
    assert after["tokens_cached"] >= 128 and after["tokens_predicted"] == 3, after  # the warmed blocks


def test_completion_names_the_stop_string_that_ended_it(client):
    free = client.post("/completion", json={"prompt": [10, 11, 12], "n_predict": 12, "temperature": 0}).json()
    word = free["content"][4:6]
    assert len(word) == 2
    ask = {"prompt": [10, 11, 12], "n_predict": 12, "temperature": 0, "stop": ["never-generated", word]}
    body = client.post("/completion", json=ask).json()
    assert body["stop_type"] == "word" and body["stopping_word"] == word
    assert body["content"] == free["content"][:free["content"].index(word)]
    r = client.post("/completion", json={**ask, "stream": True})
    final = json.loads([e for e in r.text.split("\n\n") if e][-1].removeprefix("data: "))
    assert final["stop_type"] == "word" and final["stopping_word"] == word
    # Ended otherwise: no stopping word.
    assert (free["stop_type"], free["stopping_word"]) == ("limit", "")


def test_completion_bad_option_names_llama_server_field(client):
    r = client.post("/completion", json={"prompt": "x", "n_probs": 99})
    assert r.status_code == 400 and "n_probs" in r.json()["error"]


def test_completion_logit_bias_in_llama_servers_forms(client, tiny):
    """[[id, value]] pairs, [[text, value]] (each of its tokens), false for a ban, and OpenAI's object."""
    tok = tiny[1].current.engine.tokenizer
    ask = {"prompt": [10, 11, 12], "n_predict": 4, "temperature": 0, "ignore_eos": True}
    free = client.post("/completion", json=ask).json()["tokens"]
    assert client.post("/completion", json={**ask, "logit_bias": [[7, 100]]}).json()["tokens"] == [7] * 4
    assert client.post("/completion", json={**ask, "logit_bias": {"7": 100}}).json()["tokens"] == [7] * 4
    banned = client.post("/completion", json={**ask, "logit_bias": [[free[0], False]]}).json()["tokens"]
    assert banned[0] != free[0] and free[0] not in banned
    word = tok.encode("ok", add_special_tokens=False)
    forced = client.post("/completion", json={**ask, "logit_bias": [["ok", 100]]}).json()["tokens"]
    assert set(forced) <= set(word)
    for bad in ([[7]], [[7, "x"]], [[-1, 1]], [[7, 1000]], "x", [[10 ** 6, 1]]):
        r = client.post("/completion", json={**ask, "logit_bias": bad})
        assert r.status_code == 400 and "logit_bias" in r.json()["error"], (bad, r.text)


def test_embedding(client, tiny):
    r = client.post("/embedding", json={"content": "hello"})
    assert r.status_code == 200 and len(r.json()["embedding"]) == tiny[1].current.engine.loaded.config.dim
    assert client.post("/embedding", json={}).status_code == 400


def test_tokenize_detokenize_round_trip(client, tiny):
    r = client.post("/tokenize", json={"content": "hello there"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["content"] == "hello there"
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"] - 2  # template tokens around the message
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_metrics_use_vllm_names_with_the_model_label(client, tiny):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    text = client.get("/metrics").text
    label = f'model_name="{model_name(tiny[1])}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert re.search(rf"^{re.escape(name)}{{{re.escape(label)}}} [0-9.e+-]+$", text, re.M), name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "tokenmill:batch_tokens_per_step", "tokenmill:batch_seqs_per_step"):
        assert f"# TYPE {name} histogram" in text
        assert re.search(rf'^{re.escape(name)}_bucket{{{re.escape(label)},le="\+Inf"}} [1-9]', text, re.M), name
        assert re.search(rf"^{re.escape(name)}_count{{{re.escape(label)}}} [1-9]", text, re.M), name
    assert int(re.search(r"^vllm:generation_tokens_total\S* (\d+)", text, re.M).group(1)) >= 2


def test_metrics_carry_the_process_collector(client):
    """Prometheus' standard process_* metrics and the peak RSS, without the model label. The server
    runs in this process here, so its figures are this process's."""
    text = client.get("/metrics").text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^((?:process_|tokenmill:peak_)\w+) (\S+)$", text, re.M)}
    assert set(values) == {"process_cpu_seconds_total", "tokenmill:peak_resident_memory_bytes",
                           "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_open_fds",
                           "process_max_fds", "process_start_time_seconds"}
    assert values["process_cpu_seconds_total"] > 0
    assert 0 < values["process_resident_memory_bytes"] <= values["tokenmill:peak_resident_memory_bytes"]
    assert values["process_resident_memory_bytes"] < values["process_virtual_memory_bytes"]
    assert 3 <= values["process_open_fds"] <= values["process_max_fds"]  # stdio and the listening socket at least
    assert "# TYPE process_cpu_seconds_total counter" in text
    assert 0 < time.time() - values["process_start_time_seconds"] < 24 * 3600
