"""`tokenmill bench quality` on a tiny model whose weights are Q4_0, so the bf16-int4 format really
packs int4 weights and uses them for the single-row decode steps."""
from __future__ import annotations

import json

import gguf
import pytest

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.cli import main
from tokenmill.kernels import variant


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_q4") / "tiny-q4.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q4_0))


def test_quality_bench_tiny(tiny_q4, tmp_path, capsys):
    out = tmp_path / "quality.json"
    rc = main(["bench", "quality", "--model", str(tiny_q4), "--max-tokens", "6", "--num-prompts", "3",
               "--formats", "bf16,bf16-int4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "identical %" in printed and "bf16-int4" in printed

    r = json.loads(out.read_text())
    assert r["benchmark"] == "quality" and r["num_prompts"] == 3 and r["max_tokens"] == 6
    assert set(r["formats"]) == {"fp32", "bf16", "bf16-int4"}
    assert r["formats"]["fp32"]["direct_argmax_matches_engine_pct"] == 100.0
    assert r["formats"]["bf16"]["int4_layers"] == 0 and r["formats"]["bf16-int4"]["int4_layers"] > 0
    assert r["compiled"] is False and r["formats"]["bf16-int4"]["compiled_steps"] == 0
    for name in ("bf16", "bf16-int4"):
        f = r["formats"][name]
        assert 0 <= f["identical_pct"] <= 100 and 0 <= f["top1_agree_pct"] <= 100
        assert 0 <= f["first_divergence_min"] <= f["first_divergence_median"] <= 6
        assert 0 <= f["prompts_fully_identical"] <= 3
        assert 0 <= f["decode_logit_mean_abs"] <= f["decode_logit_max_abs"]
        assert 0 <= f["prefill_logit_mean_abs"] <= f["prefill_logit_max_abs"]
        assert f["decode_logit_max_abs"] > 0  # bf16 rounding moves something
        assert len(f["per_prompt"]) == 3
        for row in f["per_prompt"]:
            assert row["tokens"] == 6 and 0 <= row["identical_pct"] <= 100
    # The prefill step has many rows, so int4 is not used there: bf16 and bf16-int4 agree exactly.
    assert r["formats"]["bf16"]["prefill_logit_max_abs"] == r["formats"]["bf16-int4"]["prefill_logit_max_abs"]
    # Decode steps are single-row, so int4 is used there and the logits differ from dense bf16.
    a = [p["decode_logit_mean_abs"] for p in r["formats"]["bf16"]["per_prompt"]]
    b = [p["decode_logit_mean_abs"] for p in r["formats"]["bf16-int4"]["per_prompt"]]
    assert a != b


@pytest.mark.slow  # compiles the tiny model's graphs
def test_quality_bench_through_the_compiled_graphs(tiny_q4, tmp_path):
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(tiny_q4), "--formats", "bf16-int4", "--max-tokens", "6",
                 "--num-prompts", "2", "--compile", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    f = r["formats"]["bf16-int4"]
    # Each prompt: a prefill step (mixed graph) and five single-row decode steps (1-row graph).
    assert r["compiled"] is True and f["compiled_steps"] == 2 * 6
    assert 0 <= f["identical_pct"] <= 100 and len(f["per_prompt"]) == 2


def test_quality_bench_on_long_corpus_prompts(tmp_path, monkeypatch):
    """--prompt-len: corpus windows long enough that the prefill attends in query pieces."""
    from tokenmill.model import attention

    path = write_tiny_llama(tmp_path / "long.gguf", TinyLlamaSpec(context_length=1024))
    calls = []
    real = attention.causal_pieces
    monkeypatch.setattr(attention, "causal_pieces", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(path), "--formats", "bf16", "--max-tokens", "3",
                 "--num-prompts", "2", "--prompt-len", "520", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = r["formats"]["bf16"]["per_prompt"]
    assert [row["prompt_tokens"] for row in rows] == [520, 520] and rows[0]["prompt"] != rows[1]["prompt"]
    # Whole in the teacher-forced pass; the engine's micro-batches of 512 cut it to 512 + 8.
    assert set(calls) == {520, 512}


def test_quality_bench_bad_args(capsys):
    assert main(["bench", "quality", "--formats", "fp8"]) == 2
    assert main(["bench", "quality", "--num-prompts", "0"]) == 2
    assert main(["bench", "quality", "--prompt-len", "1"]) == 2
    assert main(["bench", "quality", "--num-prompts", "9"]) == 2  # 8 chat prompts; more needs --prompt-len


@pytest.mark.skipif(variant() == "torch", reason="native kernels not built")
def test_quality_bench_measures_the_native_formats(tiny_q4, tmp_path):
    out = tmp_path / "quality.json"
    rc = main(["bench", "quality", "--model", str(tiny_q4), "--max-tokens", "6", "--num-prompts", "2",
               "--formats", "gguf,gguf-kv8", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r["formats"]) == {"fp32", "gguf", "gguf-kv8"}
    assert r["formats"]["fp32"]["direct_argmax_matches_engine_pct"] == 100.0
    for name in ("gguf", "gguf-kv8"):
        f = r["formats"][name]
        assert 0 <= f["identical_pct"] <= 100 and len(f["per_prompt"]) == 2
        assert 0 < f["decode_logit_mean_abs"] <= f["decode_logit_max_abs"]  # int8 activations and the bf16 cache move something
