"""bench/gpu/check.py, the GPU box's check, run here as its dry run (--device cpu) on the tiny models:
every step's plumbing end to end, the greedy/logits comparison, pytest's counts and the summary's
verdicts (a target with no result is never a pass; a dry run is never a measurement)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))

import check  # noqa: E402
import gpu_report  # noqa: E402
import gpu_runs  # noqa: E402


def run(tokens: list[int], rows: list[list[float]]) -> dict:
    return {"tokens": tokens, "logits": [torch.tensor(r) for r in rows]}


def test_compare_greedy_equal_close_and_far():
    ref = run([0, 1], [[5.0, 1.0, 0.0], [1.0, 4.0, 0.0]])
    close = gpu_runs.compare_greedy(ref, run([0, 1], [[5.05, 1.0, 0.0], [1.0, 4.0, 0.1]]), 0.03)
    assert close["ok"] and close["tokens_equal"] and close["max_rel_diff"] == pytest.approx(0.025)
    far = gpu_runs.compare_greedy(ref, run([0, 1], [[5.0, 1.0, 0.0], [1.0, 4.0, 1.0]]), 0.03)
    assert not far["ok"] and far["max_rel_diff"] == pytest.approx(0.25)


def test_compare_greedy_parting_at_a_near_tie_or_not():
    ref = run([0, 1, 2], [[5.0, 4.95, 0.0], [0.0, 5.0, 1.0], [0, 0, 5.0]])
    tie = gpu_runs.compare_greedy(ref, run([1, 2, 2], [[4.95, 5.0, 0.0], [0.0, 1.0, 5.0], [0, 0, 5.0]]), 0.03)
    assert tie["ok"] and not tie["tokens_equal"]
    assert tie["parted"]["step"] == 0 and tie["parted"]["near_tie"] and tie["agreeing_prefix"] == 0
    wrong = gpu_runs.compare_greedy(ref, run([0, 2, 2], [[5.0, 4.95, 0.0], [0.0, 5.0, 5.01], [0, 0, 5.0]]), 0.5)
    assert not wrong["ok"] and wrong["parted"] == {"step": 1, "ref_token": 1, "got_token": 2,
                                                   "ref_margin_rel": pytest.approx(0.8), "near_tie": False}


def test_compare_greedy_sees_a_masked_token_on_one_side_only():
    inf = float("-inf")
    ref = run([0], [[5.0, inf, 1.0]])
    assert gpu_runs.compare_greedy(ref, run([0], [[5.0, inf, 1.0]]), 0.03)["ok"]
    assert not gpu_runs.compare_greedy(ref, run([0], [[5.0, 3.0, 1.0]]), 0.03)["ok"]


def test_pytest_counts_whole_and_cut_short():
    assert check.pytest_counts("..F\n=== 1 failed, 2 passed in 3.0s ===") == {
        "summary": "1 failed, 2 passed in 3.0s", "failed": 1, "passed": 2}
    assert check.pytest_counts("....s  [ 40%]\n.E\n") == {"summary": "cut short after 7 tests", "passed": 5,
                                                         "skipped": 1, "errors": 1}


def write(out: Path, step: str, data: dict) -> None:
    (out / f"{step}.json").write_text(json.dumps(data))


def test_summary_verdicts(tmp_path):
    write(tmp_path, "env", {"device": "cuda", "gpu": "NVIDIA H100", "sizes": {"concurrency": [64, 256]}})
    write(tmp_path, "decode", {"smollm2": {"decode_tok_s": 1500.0, "graph_steps": 640, "decode_steps": 4},
                               "smollm2-one-step": {"decode_tok_s": 900.0, "decode_steps": 1},
                               "gemma3": {"decode_tok_s": 650.0, "graph_steps": 640}})
    write(tmp_path, "concurrency", {"64": {"output_tok_s": 25000.0, "ttft_ms": {"p50": 120.0}}})
    write(tmp_path, "anchor", {"batches": {"1": {"output_tok_s": 50.0}, "64": {"output_tok_s": 3000.0}}})
    write(tmp_path, "kernel-tests", {"rc": 1, "passed": 70, "failed": 2})
    text, data = gpu_report.render(tmp_path)
    met = {r["what"].split(" (")[0]: r["met"] for r in data["rows"]}
    assert met["smollm2 single-stream decode tok/s"] == "yes"
    assert met["gemma3 single-stream decode tok/s"] == "NO"
    assert met["64 concurrent output tok/s"] == "yes" and met["64 concurrent TTFT p50 ms"] == "NO"
    assert met["256 concurrent output tok/s"] == "not measured"
    assert met["GPU tests"] == "NO" and met["logits and greedy tokens vs the CPU path"] == "not measured"
    assert "NVIDIA H100" in text and "3,000.0" in text
    assert "640 graph steps, 4 steps in a row" in text
    one = next(r for r in data["rows"] if r["what"].endswith("one step at a time"))
    assert one["value"] == "900.0" and one["met"] == "-"
    assert set(data["missing"]) == {"correctness", "invariance"}
    # the tests' step stopped at its time limit with no failure so far: said so, not called a failure
    write(tmp_path, "kernel-tests", {"rc": 124, "passed": 60, "skipped": 2, "summary": "cut short after 62 tests"})
    row = next(r for r in gpu_report.render(tmp_path)[1]["rows"] if r["what"].startswith("GPU tests"))
    assert row["met"] == "none failed" and "cut short" in row["value"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-check")
    return {"smollm2": write_tiny_llama(d / "llama.gguf", TinyLlamaSpec(context_length=512)),
            "gemma3": write_tiny_gemma3(d / "gemma.gguf", tiny_spm_metadata(), TinyGemma3Spec(context_length=512))}


@pytest.mark.slow
def test_dry_run_of_every_engine_step(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    models = [f"--model={name}={path}" for name, path in tiny_models.items()]
    rc = check.main(["--device", "cpu", "--small", "--out", str(out), *models,
                     "--steps", "env,correctness,decode,concurrency,invariance,summary"])
    assert rc == 0
    correctness = json.loads((out / "correctness.json").read_text())
    for name in ("smollm2", "gemma3"):
        comparisons = correctness["models"][name]
        assert set(comparisons) == {"cpu-eager vs cpu-fp32", "cpu-eager vs cpu-bf16"}
        # The dry run's device side is the CPU's bf16 path itself: bitwise its logits, close to fp32's.
        assert comparisons["cpu-eager vs cpu-bf16"]["max_abs_diff"] == 0.0
        assert 0 < comparisons["cpu-eager vs cpu-fp32"]["max_rel_diff"] < 0.1
    decode = json.loads((out / "decode.json").read_text())
    assert decode["smollm2"]["decode_tok_s"] > 0 and decode["gemma3"]["decode_tok_s"] > 0
    conc = json.loads((out / "concurrency.json").read_text())
    assert set(conc) >= {"3", "5"} and conc["5"]["output_tokens"] == 5 * check.SMALL.new_tokens
    inv = json.loads((out / "invariance.json").read_text())
    assert inv["identical"] == {"equal": 3, "of": 3} and inv["mixed"]["equal"]
    summary = (out / "summary.txt").read_text()
    assert "DRY RUN" in summary and "(dry run)" in summary and " yes" not in summary.split("transformers:")[0]
    assert "steps with no result (failed, cut short or not run): kernel-tests, anchor" in summary


@pytest.mark.slow
def test_kernel_tests_step_runs_pytest_and_counts(tmp_path):
    c = check.Check("cpu", {}, tmp_path, check.SMALL, ["tests/model/gpu/test_buckets.py"], 120)
    r = check.step_kernel_tests(c)
    assert r["rc"] == 0 and r["passed"] >= 8 and "failed" not in r


def test_profile_step_on_the_cpu(tiny_models, tmp_path, capsys):
    """The profile step's plumbing (its figures mean something on a GPU only): step times, no graph to
    replay on the CPU, the engine's functions and torch's ops named."""
    out = tmp_path / "out"
    rc = check.main(["--device", "cpu", "--small", "--out", str(out), f"--model=smollm2={tiny_models['smollm2']}",
                     "--steps", "profile"])
    assert rc == 0
    prof = json.loads((out / "profile.json").read_text())
    assert {k for k in prof if k.startswith("smollm2-")} == {"smollm2-1", "smollm2-5"}  # alone, the largest concurrency
    one = prof["smollm2-1"]
    assert one["step_ms_median"] > 0 and one["tok_s"] > 0 and one["graph_replay_ms"] is None
    assert "engine.py" in one["cprofile"] and "engine steps, by host time" in one["torch_profile"]
    assert "smollm2, 5 sequences: step" in capsys.readouterr().out
