"""/metrics with several models loaded at once: every model's engine series, each sample labelled
model_name="<name>" with that model's own numbers, in valid Prometheus text (each family's HELP and
TYPE once, then all of its samples); with no model loaded, valid and without engine series."""
from __future__ import annotations

import json
import re
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import start_server, wait_idle
from tokenmill.engine.stats import HistogramSnapshot, StatsSnapshot
from tokenmill.server.metrics_engine import EngineCounters, ModelEngine, render_engines

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def check_text_format(text: str) -> dict[str, list[tuple[str, str]]]:
    """Asserts the page is well-formed Prometheus text: each family's HELP and TYPE once, before any
    of its samples, and all its samples in one run after them, no label set twice. Returns each
    family's samples as (name+labels, value)."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[str, str]]] = {}
    kinds: dict[str, str] = {}
    helps: set[str] = set()
    current = None
    for line in text.splitlines():
        assert line, "blank line in the page"
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, word, name, rest = line.split(" ", 3)
            seen = helps if word == "HELP" else kinds
            assert name not in seen, f"{word} of {name} twice"
            if word == "HELP":
                helps.add(name)
            else:
                kinds[name] = rest
            assert name not in families or not families[name], f"{word} of {name} after its samples"
            if current != name:
                assert name not in families, f"{name}'s header split"
            families.setdefault(name, [])
            current = name
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name = m.group(1)
        family = name
        if kinds.get(current) == "histogram" and name.endswith(HISTOGRAM_SUFFIXES):
            family = name.rsplit("_", 1)[0]
        assert family == current, f"sample {name} outside its family ({current} is open)"
        assert current in helps and current in kinds, f"{current} lacks HELP or TYPE"
        families[current].append((name + (m.group(2) or ""), m.group(3)))
    assert helps == set(kinds), "a family with HELP but no TYPE, or the reverse"
    for name, samples in families.items():
        keys = [k for k, _ in samples]
        assert len(keys) == len(set(keys)), f"{name} repeats a label set"
    # prometheus_client's parser reads it too.
    parsed = {f.name for f in text_string_to_metric_families(text)}
    assert parsed == {n.removesuffix("_total") if kinds[n] == "counter" else n for n in families}
    return families


def values(text: str, name: str) -> dict[str, float]:
    """model_name -> value of the samples of `name` (one label besides model_name at most summed over)."""
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{model_name="([^"]+)"[^}}]*\}} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def generate(c: httpx.Client, model: str, n: int) -> dict:
    r = c.post("/api/generate", json={"model": model, "prompt": "hello", "stream": False,
                                      "options": {"num_predict": n, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_two_loaded_models_each_show_their_own_engine_series(store):
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30), host.error
            a_tokens = generate(c, "tiny-a", 3)["eval_count"]
            generate(c, "tiny-b", 2)  # loads tiny-b
            b = host.find_loaded("tiny-b").engine

            # Hold tiny-b's engine in its second step of a stream: the scrape reads the snapshot
            # published after the first one (never waits for the held step), with the stream running.
            in_step, go, steps = threading.Event(), threading.Event(), []

            def hold(batch):
                steps.append(batch)
                if len(steps) == 2:
                    in_step.set()
                    go.wait(30)

            final = {}

            def stream():
                with httpx.stream("POST", f"{server.url}/api/generate", timeout=30, json={
                        "model": "tiny-b", "prompt": "hi there", "options": {"num_predict": 6, "temperature": 0}}) as r:
                    for line in r.iter_lines():
                        if line:
                            final.update(json.loads(line))

            b.step_hook = hold
            t = threading.Thread(target=stream)
            t.start()
            try:
                assert in_step.wait(30)
                busy = c.get("/metrics", timeout=10).text
            finally:
                go.set()
                b.step_hook = None
                t.join(30)
            assert final["done"] is True
            wait_idle(host)
            text = c.get("/metrics").text
    finally:
        server.stop()

    for page in (busy, text):
        fams = check_text_format(page)
        # The server's own series once, not per model.
        for name in ("tokenmill:requests_in_flight", "tokenmill:requests_rejected_total", "tokenmill:model_ready",
                     "process_cpu_seconds_total", "tokenmill:torch_threads"):
            assert len(fams[name]) == 1, name
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                     "vllm:prefix_cache_queries_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                     "tokenmill:engine_healthy", "tokenmill:engine_snapshot_age_seconds",
                     "tokenmill:spec_decode_num_drafts_total"):
            assert set(values(page, name)) == {"tiny-a", "tiny-b"}, name

    # While tiny-b's stream runs, its queue and KV cache show it; tiny-a's show nothing running.
    assert values(busy, "vllm:num_requests_running") == {"tiny-a": 0, "tiny-b": 1}
    assert values(busy, "vllm:kv_cache_usage_perc")["tiny-b"] > 0
    assert values(busy, "tokenmill:kv_cache_used_blocks")["tiny-b"] > 0
    assert values(busy, "tokenmill:kv_cache_used_blocks")["tiny-a"] == 0
    assert values(busy, "tokenmill:engine_healthy") == {"tiny-a": 1, "tiny-b": 1}

    # Afterwards: each model counts what its own requests generated, and their finishes.
    b_tokens = 2 + final["eval_count"]
    assert values(text, "vllm:generation_tokens_total") == {"tiny-a": a_tokens, "tiny-b": b_tokens}
    assert values(text, "vllm:request_success_total") == {"tiny-a": 1, "tiny-b": 2}
    assert values(text, "vllm:e2e_request_latency_seconds_count") == {"tiny-a": 1, "tiny-b": 2}
    assert re.search(r'^vllm:e2e_request_latency_seconds_bucket\{model_name="tiny-b",le="\+Inf"\} 2$', text, re.M)
    assert values(text, "vllm:num_requests_running") == {"tiny-a": 0, "tiny-b": 0}
    prompts = values(text, "vllm:prompt_tokens_total")
    assert prompts["tiny-a"] > 0 and prompts["tiny-b"] > 0


def test_no_model_loaded_is_valid_and_has_no_engine_series(store):
    server, host = start_server("")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.loaded_models() == []
            r = c.get("/metrics")
    finally:
        server.stop()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = check_text_format(r.text)
    assert "vllm:" not in r.text and "tokenmill:engine_" not in r.text and "model_name=" not in r.text
    assert fams["tokenmill:requests_in_flight"] == [("tokenmill:requests_in_flight", "0")]
    assert "process_cpu_seconds_total" in fams and "tokenmill:torch_threads" in fams


def _snapshot(generated: int, finished: dict[str, int], per_position: tuple[int, ...] = ()) -> StatsSnapshot:
    hist = HistogramSnapshot([(0.1, 1), (float("inf"), 2)], 0.3, 2)
    return StatsSnapshot(0, 0, 0.25, 3, 10, 4, 0, 20, 4, generated, 5, finished,
                         {k: hist for k in ("ttft", "itl", "e2e", "queue_time", "tokens_per_step", "seqs_per_step")},
                         spec_accepted_per_position=per_position)


def test_render_engines_writes_each_family_once_with_a_sample_per_model():
    engines = [ModelEngine("m1", _snapshot(7, {"stop": 1, "length": 2}, (3, 1)), EngineCounters(True, 0, 0, 0.5)),
               ModelEngine('odd "name"\\', _snapshot(9, {"stop": 4}), EngineCounters(False, 2, 1, 1.5))]
    text = render_engines(engines)
    fams = check_text_format(text)
    assert fams["vllm:generation_tokens_total"] == [('vllm:generation_tokens_total{model_name="m1"}', "7"),
                                                    ('vllm:generation_tokens_total{model_name="odd \\"name\\"\\\\"}',
                                                     "9")]
    assert [k for k, _ in fams["vllm:request_success_total"]] == [
        'vllm:request_success_total{model_name="m1",finished_reason="length"}',
        'vllm:request_success_total{model_name="m1",finished_reason="stop"}',
        'vllm:request_success_total{model_name="odd \\"name\\"\\\\",finished_reason="stop"}']
    # Only m1 speculates: its positions alone.
    assert [k for k, _ in fams["tokenmill:spec_decode_num_accepted_tokens_per_pos_total"]] == [
        'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m1",position="0"}',
        'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m1",position="1"}']
    assert len(fams["vllm:time_to_first_token_seconds"]) == 2 * 4  # two buckets, sum and count per model
    assert [v for _, v in fams["tokenmill:engine_healthy"]] == ["1", "0"]
    # The label survives prometheus_client's parser, quotes and backslashes included.
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["model_name"] for s in parsed["vllm:kv_cache_usage_perc"].samples} == {"m1", 'odd "name"\\'}
    assert render_engines([]) == ""
