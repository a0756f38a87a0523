"""Smoke test of `tokenmill bench speculative` on a tiny GGUF model: it runs end to end, compares the
greedy tokens on and off, and reports sane numbers (no timing assertions)."""
from __future__ import annotations

import json

import gguf
import pytest

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.cli import main
from tokenmill.kernels import variant


@pytest.mark.skipif(variant() == "torch", reason="native kernels not built: the engine does not speculate")
def test_speculative_bench_tiny(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "q.gguf", TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0,
                                                                 context_length=2048))
    out = tmp_path / "spec.json"
    rc = main(["bench", "speculative", "--model", str(model), "--only", "code-typehints,story", "--max-tokens", "12",
               "--repeats", "2", "--burst-repeats", "1", "--skip-llama-cpp", "--bound", "--predicted", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "grounded (geomean)" in printed and "burst of 16" in printed and "DIFFER" not in printed
    assert "predicted" in printed
    r = json.loads(out.read_text())
    assert [x["name"] for x in r["results"]] == ["code-typehints", "story"]
    for x in r["results"]:
        assert x["same"] and x["off_tok_s"] > 0 and x["on_tok_s"] > 0 and len(x["runs"]["on"]) == 2
        assert 0 <= x["acceptance"] <= 1
        assert x["predicted_tok_s"] > 0  # --predicted: each answer as its own prediction (the tokens the same)
    assert r["burst"]["same"] and r["burst"]["on_tok_s"] > 0
    # --bound: a step's cost for 1..k+1 rows, and each prompt's answer replayed at those costs.
    assert "what this machine allows" in printed and "perfect length" in printed
    assert [int(k) for k in r["bound"]["step_ms"]] == list(range(1, 18))  # the engine's cap of 16, plus one
    assert all(ms > 0 for ms in r["bound"]["step_ms"].values())
    assert set(r["bound"]["prompts"]) == {"code-typehints", "story"}
    for x in r["bound"]["prompts"].values():
        assert x["perfect_length"] > 0 and x["policy"] > 0
