"""Smoke test of the benchmarks on the tiny model: they run end to end and report sane numbers.
No timing assertions: only that the figures exist, are positive and add up."""
from __future__ import annotations

import json

import pytest

from tokenmill.cli import main


def test_offline_bench_tiny(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(tiny_gguf), "--num-prompts", "5", "--prompt-len", "12",
               "--max-tokens", "6", "--n-batch", "32", "--parallel", "4", "--max-total-tokens", "1024",
               "--skip-hf", "--no-compile", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "step ms" in printed

    r = json.loads(out.read_text())
    assert r["benchmark"] == "offline" and r["hf"] is None
    tm = r["tokenmill"]
    assert tm["prompt_tokens"] == 5 * 12
    assert tm["output_tokens"] == tm["expected_output_tokens"] == 5 * 6  # EOS ignored: every token arrives
    for key in ("output_tok_s", "prefill_tok_s", "total_tok_s", "elapsed_seconds", "prefill_seconds",
                "load_seconds", "kv_cache_bytes", "kv_used_peak_bytes", "peak_rss_bytes"):
        assert tm[key] > 0, key
    assert tm["prefill_seconds"] <= tm["elapsed_seconds"]
    assert tm["kv_used_peak_bytes"] <= tm["kv_cache_bytes"]
    # parallel=4 < 5 prompts and a 32-token budget: several steps, some of them decode-only
    assert tm["num_steps"] >= 6 and tm["num_decode_steps"] >= 1
    s = tm["step_ms"]
    assert 0 < s["p50"] <= s["p95"] <= s["p99"] <= s["max"]
    assert 0 < tm["decode_step_ms"]["p50"]
    assert r["ratio_tokenmill_over_hf"]["output_tok_s"] is None


def test_single_stream_bench_tiny(tiny_gguf, tmp_path):
    out = tmp_path / "single.json"
    rc = main(["bench", "single-stream", "--model", str(tiny_gguf), "--prompt-len", "10", "--max-tokens", "5",
               "--repeats", "2", "--max-total-tokens", "512", "--skip-hf", "--no-compile", "--dtypes", "auto,bf16",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"auto", "bf16"}
    for entry in r["runs"].values():
        tm = entry["tokenmill"]
        assert tm["decode_tok_s"] > 0 and tm["prefill_tok_s"] > 0 and tm["load_seconds"] > 0
        assert len(tm["decode_tok_s_runs"]) == 2
        assert entry["hf"] is None


def test_chat_bench_tiny(tiny_gguf, tmp_path, capsys):
    """bench chat without its peer: every turn after the first takes the conversation so far from the
    prefix cache (its previous prompt and reply, to the token) and computes only what is new."""
    out = tmp_path / "chat.json"
    rc = main(["bench", "chat", "--model", str(tiny_gguf), "--turns", "3", "--max-tokens", "6", "--repeats", "2",
               "--skip-llama-cpp", "--json", str(out)])
    assert rc == 0
    assert "turns 2..3: tokenmill computed" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["llama_cpp"] is None and len(r["tokenmill"]["turns"]) == 3
    turns = r["tokenmill"]["turns"]
    assert turns[0]["computed_tokens"] == turns[0]["prompt_tokens"]  # an empty cache
    for before, turn in zip(turns, turns[1:]):
        assert turn["prompt_tokens"] > before["prompt_tokens"]
        assert 0 < turn["computed_tokens"] <= turn["prompt_tokens"] - before["prompt_tokens"]
        assert turn["ttft_ms"] > 0 and len(turn["ttft_ms_runs"]) == 2
    later = r["tokenmill"]["later_turns"]
    assert later["computed_tokens"] == sum(t["computed_tokens"] for t in turns[1:])
    with pytest.raises(SystemExit, match="outgrows the 256-token context"):  # not a traceback mid-run
        main(["bench", "chat", "--model", str(tiny_gguf), "--max-tokens", "300", "--skip-llama-cpp"])


def test_bench_usage(capsys):
    assert main(["bench"]) == 2
    assert main(["bench", "nope"]) == 2
    assert "offline" in capsys.readouterr().out


def test_structured_bench_tiny(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "structured.json"
    rc = main(["bench", "structured", "--model", str(tiny_gguf), "--num-requests", "3", "--max-tokens", "40",
               "--max-total-tokens", "1024", "--dtype", "fp32", "--repeats", "1", "--json", str(out)])
    assert rc == 0
    assert "ratio" in capsys.readouterr().out
    r = json.loads(out.read_text())
    c, u = r["constrained"], r["unconstrained"]
    assert c["output_tokens"] == u["output_tokens"] > 0  # the same work on both sides
    assert len(c["runs_output_tok_s"]) == len(u["runs_output_tok_s"]) == 1
    assert c["mask_us_per_token"] > 0 and r["compile_seconds"] > 0
