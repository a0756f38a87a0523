"""`tokenmill bench serve` and `tokenmill bench shared-prefix` against a real tokenmill server on the
tiny model (in this process, on a free loopback port). No timing assertions: only that the figures
exist, add up and are ordered."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # the server tests' helpers
from server_helpers import start_server, wait_idle  # noqa: E402
from tokenmill.bench.loadgen import BenchError, check_loopback, parse_length  # noqa: E402
from tokenmill.bench.server_metrics import parse_metrics, server_latencies, server_peak_rss_mib  # noqa: E402
from tokenmill.cli import main  # noqa: E402
from tokenmill.process_stats import peak_rss_bytes  # noqa: E402

PCT_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server(tiny_gguf):
    srv, host = start_server(str(tiny_gguf))
    assert host.wait_ready(60), host.error
    yield srv, host
    srv.stop()


def _ordered(p: dict) -> bool:
    return 0 <= p["p50"] <= p["p95"] <= p["p99"] <= p["max"]


@pytest.mark.parametrize("api", ["openai", "ollama", "anthropic"])
def test_serve_bench_fixed_concurrency(server, tiny_gguf, tmp_path, capsys, api):
    srv, host = server
    out = tmp_path / f"{api}.json"
    rc = main(["bench", "serve", "--url", srv.url, "--api", api, "--num-requests", "6", "--concurrency", "3",
               "--max-tokens", "4", "--prompt-len", "uniform:8:16", "--ignore-eos", "--tokenizer", str(tiny_gguf),
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and "the server's (/metrics)" in printed
    assert "server's peak RSS so far (/metrics)" in printed
    wait_idle(host)
    r = json.loads(out.read_text())
    assert r["benchmark"] == "serve" and r["model"] and r["prompt_lengths_exact"] is True
    assert r["loadavg_start"] and r["config"]["api"] == api
    (run,) = r["runs"]
    assert run["concurrency"] == 3
    assert run["num_requests"] == run["num_completed"] == 6
    assert run["num_errors"] == 0 and run["num_not_started"] == 0 and run["errors"] == {}
    assert run["output_tokens_counted_by"] == "server" and run["prompt_tokens_counted_by"] == "server"
    if api != "ollama":  # EOS ignored: every request gets exactly max-tokens
        assert run["output_tokens"] == 6 * 4
    else:  # Ollama's API has no ignore_eos: num_predict is only a cap
        assert 6 <= run["output_tokens"] <= 6 * 4
    assert run["prompt_tokens"] >= 6 * 8
    for key in ("duration_s", "request_per_s", "output_tok_s", "total_tok_s"):
        assert run[key] > 0, key
    assert run["total_tok_s"] > run["output_tok_s"]
    for key in PCT_KEYS:
        assert _ordered(run[key]), (key, run[key])
    assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]
    assert run["e2e_ms"]["max"] <= run["duration_s"] * 1000 + 1
    # The server's own view of the same requests: from intake, so within what the client saw.
    sv = run["server"]
    assert 0 < sv["ttft_mean_ms"] <= run["ttft_ms"]["max"]
    assert 0 <= sv["queue_mean_ms"] <= sv["ttft_mean_ms"]
    # The server runs in this process here: its peak RSS is this process's, read a moment earlier.
    assert 100 < run["server_peak_rss_mib"] <= peak_rss_bytes() / 2**20


def test_serve_bench_rate_and_chat(server, tmp_path):
    srv, host = server
    out = tmp_path / "rate.json"
    rc = main(["bench", "serve", "--url", srv.url, "--chat", "--rate", "50", "--num-requests", "4",
               "--max-tokens", "uniform:2:3", "--prompt-len", "6", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    wait_idle(host)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["rate"] == 50 and run["num_completed"] == 4 and run["output_tokens"] > 0


def test_serve_bench_sweep_chart(server, tmp_path):
    srv, host = server
    out, chart = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["bench", "serve", "--url", srv.url, "--sweep", "1,2,4", "--num-requests", "4", "--max-tokens", "3",
               "--prompt-len", "8", "--ignore-eos", "--json", str(out), "--chart", str(chart)])
    assert rc == 0
    wait_idle(host)
    r = json.loads(out.read_text())
    assert [x["concurrency"] for x in r["runs"]] == [1, 2, 4]
    assert all(x["num_completed"] == 4 and x["output_tokens"] == 12 for x in r["runs"])
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["chart"] == str(chart)


def test_serve_bench_counts_errors(server, tmp_path):
    srv, _ = server
    out = tmp_path / "err.json"
    # A model name the server does not serve: every request fails with 404, and the run says so.
    rc = main(["bench", "serve", "--url", srv.url, "--model", "no-such-model", "--num-requests", "3",
               "--concurrency", "2", "--max-tokens", "2", "--warmup", "0", "--json", str(out)])
    assert rc == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert run["num_errors"] == 3 and run["num_completed"] == 0
    assert any("HTTP 404" in msg for msg in run["errors"])


def test_shared_prefix_bench(server, tiny_gguf, tmp_path, capsys):
    srv, host = server
    out = tmp_path / "shared.json"
    rc = main(["bench", "shared-prefix", "--url", srv.url, "--burst", "4", "--prefix-len", "100",
               "--question-len", "6", "--max-tokens", "2", "--tokenizer", str(tiny_gguf), "--json", str(out)])
    assert rc == 0
    assert "shared median TTFT / unique median TTFT" in capsys.readouterr().out
    wait_idle(host)
    r = json.loads(out.read_text())
    ph = r["phases"]
    assert ph["cold"]["num_completed"] == 1
    assert ph["shared"]["num_completed"] == ph["unique"]["num_completed"] == 4
    assert r["metrics_available"] is True
    # The server reports cached_tokens: all shared requests reused the prefix, no unique one did.
    assert ph["shared"]["cached_tokens"]["requests_reused"] == 4
    assert ph["unique"]["cached_tokens"]["requests_reused"] == 0
    assert ph["cold"]["cached_tokens"]["requests_reused"] == 0
    assert ph["shared"]["metrics"]["hit_tokens"] > 0 and ph["unique"]["metrics"]["hit_tokens"] == 0
    assert ph["shared"]["metrics"]["hit_tokens"] == sum(x["cached_tokens"] for x in ph["shared"]["requests"])
    assert r["unique_first_tokens_distinct"] is True
    assert r["ttft_ratio_shared_over_unique_p50"] > 0
    for name in ("shared", "unique"):
        assert _ordered(ph[name]["ttft_ms"])


def test_shared_prefix_bench_ollama(server, tmp_path):
    srv, host = server
    out = tmp_path / "shared_ollama.json"
    rc = main(["bench", "shared-prefix", "--url", srv.url, "--api", "ollama", "--burst", "3", "--prefix-len", "40",
               "--question-len", "5", "--max-tokens", "2", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    wait_idle(host)
    ph = json.loads(out.read_text())["phases"]
    assert ph["shared"]["cached_tokens"] is None  # Ollama's API does not say; /metrics does
    # /api/generate puts each prompt in the chat template: the unique burst still shares the template's
    # opening tokens, which the prefix cache gives to the token; nothing of the prompts' own text.
    tok = host.current.engine.tokenizer
    opening = tok.apply_chat_template([{"role": "user", "content": "\x00"}]).split("\x00")[0]
    num_opening = len(tok.encode(opening, add_special_tokens=False))
    assert ph["shared"]["metrics"]["hit_tokens"] > 3 * num_opening
    assert ph["unique"]["metrics"]["hit_tokens"] <= 3 * num_opening


@pytest.mark.parametrize("bench", ["serve", "shared-prefix"])
@pytest.mark.parametrize("url", ["http://10.1.2.3:11434", "http://example.com", "http://192.168.0.1:80",
                                 "ftp://127.0.0.1"])
def test_non_loopback_refused(bench, url, capsys):
    assert main(["bench", bench, "--url", url, "--num-requests" if bench == "serve" else "--burst", "1"]) == 2
    err = capsys.readouterr().err
    assert "loopback" in err or "http://127.0.0.1" in err


def test_loopback_check():
    for ok in ("http://127.0.0.1:1", "http://localhost:11434/", "http://[::1]:8080", "http://127.1.2.3"):
        assert check_loopback(ok) == ok.rstrip("/")
    for bad in ("http://8.8.8.8", "http://127.0.0.1.evil.com", "http://localhost.example.org", "127.0.0.1:80"):
        with pytest.raises(BenchError):
            check_loopback(bad)


def test_bad_arguments(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--rate", "0"]) == 2
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--sweep", "1,2", "--rate", "3"]) == 2
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--prompt-len", "uniform:9:3"]) == 2
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--chart", "x.png"]) == 2
    # Nothing listens on port 9: the model cannot be detected, and the run stops at once.
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "1"]) == 2
    assert "error" in capsys.readouterr().err


def test_helpers():
    import random

    rng = random.Random(0)
    assert parse_length("7")(rng) == 7
    assert all(3 <= parse_length("uniform:3:5")(rng) <= 5 for _ in range(20))
    text = ('# HELP a x\n# TYPE a counter\nvllm:prefix_cache_hits_total{model_name="m"} 32\n'
            'vllm:prefix_cache_queries_total{model_name="m"} 100\nbad line\n')
    m = parse_metrics(text)
    assert m["vllm:prefix_cache_hits_total"] == 32 and m["vllm:prefix_cache_queries_total"] == 100

    before = {"vllm:time_to_first_token_seconds_sum": 1.0, "vllm:time_to_first_token_seconds_count": 2,
              "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_queue_time_seconds_count": 2}
    after = {"vllm:time_to_first_token_seconds_sum": 2.2, "vllm:time_to_first_token_seconds_count": 6,
             "vllm:request_queue_time_seconds_sum": 0.9, "vllm:request_queue_time_seconds_count": 6}
    assert server_latencies(before, after) == pytest.approx({"ttft_mean_ms": 300.0, "queue_mean_ms": 100.0})
    assert server_latencies(None, after) is None  # a server without /metrics (llama.cpp's)
    assert server_latencies(after, after) is None  # nothing finished between the scrapes
    assert server_latencies({}, {"other": 1.0}) is None
    assert server_peak_rss_mib({"tokenmill:peak_resident_memory_bytes": 3 * 2**20}) == 3
    assert server_peak_rss_mib({}) is None and server_peak_rss_mib(None) is None  # llama.cpp's server


def test_run_load_stops_at_duration(server):
    """A Poisson run whose duration ends before most arrivals: the rest are not started."""
    from tokenmill.bench.api_streams import ApiOptions
    from tokenmill.bench.loadgen import LoadConfig, RequestSpec, run_load

    srv, host = server
    specs = [RequestSpec(f"hello {i}", 2, 2) for i in range(50)]
    results, wall, skipped = asyncio.run(run_load(srv.url, ApiOptions(model=""), specs,
                                                  LoadConfig(rate=5.0, duration=0.5, request_timeout=30)))
    wait_idle(host)
    assert skipped > 0 and len(results) + skipped == 50
    assert all(r.ok for r in results)


def test_stream_parsing_tokens_without_text():
    """A completion whose only token has no text (e.g. EOS) still has a first token time."""
    from tokenmill.bench.api_streams import RequestResult, take_anthropic, take_ollama, take_openai

    res = RequestResult(start=1.0)
    take_openai({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, res, False, 1.5)
    take_openai({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1,
                                           "prompt_tokens_details": {"cached_tokens": 0}}}, res, False, 1.6)
    assert res.ttft is None and res.first_event == 1.5 and res.output_tokens == 1 and res.cached_tokens == 0
    chat = RequestResult(start=0.0)
    take_openai({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, chat, True, 0.1)
    assert chat.first_event is None  # the role announcement is not a token
    take_openai({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, chat, True, 0.3)
    assert chat.ttft == 0.3 and chat.chunk_times == [0.3]
    ol = RequestResult(start=0.0)
    assert not take_ollama({"response": "a", "done": False}, ol, False, 0.2)
    assert take_ollama({"response": "", "done": True, "eval_count": 2, "prompt_eval_count": 5}, ol, False, 0.4)
    assert ol.ttft == 0.2 and ol.output_tokens == 2 and ol.prompt_tokens == 5
    with pytest.raises(RuntimeError):
        take_openai({"error": {"message": "boom"}}, RequestResult(), False, 0.0)
    an = RequestResult(start=0.0)
    for kind in ("message_start", "content_block_start"):
        assert not take_anthropic({"type": kind}, an, 0.1)
    assert an.first_event is None  # announcements, not tokens
    assert not take_anthropic({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}, an, 0.3)
    assert not take_anthropic({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                               "usage": {"input_tokens": 3, "cache_read_input_tokens": 4, "output_tokens": 2}}, an, 0.4)
    assert take_anthropic({"type": "message_stop"}, an, 0.5)
    assert an.ttft == 0.3 and an.output_tokens == 2 and an.prompt_tokens == 7 and an.cached_tokens == 4
    with pytest.raises(RuntimeError, match="boom"):
        take_anthropic({"type": "error", "error": {"type": "api_error", "message": "boom"}}, RequestResult(), 0.0)
