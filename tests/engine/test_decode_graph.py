"""The compiled decode steps (model/decode_graph.py) and prefill/mixed steps (model/step_graph.py)
against the eager forward they replace."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_helpers import make_engine, random_ids, run_to_completion
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.engine import SamplingParams
from tokenmill.kernels import use_variant
from tokenmill.model import load_model
from tokenmill.model.decode_graph import MAX_BLOCKS

pytestmark = pytest.mark.slow  # each engine compiles three graphs (tens of seconds, cached on disk after)


@pytest.fixture(autouse=True)
def pytorch_path():
    """The compiled graphs belong to the PyTorch path (the native kernels' path runs eagerly)."""
    with use_variant("torch"):
        yield


def _compare_paths(engine, diffs: list[tuple[str, int, float]]):
    """Run every step that a compiled graph takes through the eager forward too; record (graph,
    rows, max logit difference). Writing the same K/V twice to the same slots is harmless, so both
    runs see the same cache. Steps where nobody samples have no logits to compare; their K/V shows
    in the later ones."""
    runner = engine.runner
    graphs = [g for g in (runner.decode_graph, runner.step_graph) if g is not None]
    run = runner.run
    runner.picks_greedy_tokens = False  # logits for every step, greedy rows' too

    def both(batch, **kwargs):  # greedy_tokens=True: tokens, no logits to compare
        before = runner.graph_steps, runner.step_graph_steps
        out = run(batch, **kwargs)
        fast = out.logits
        after = runner.graph_steps, runner.step_graph_steps
        if fast is None or after == before:
            return out
        for g in graphs:
            g.ready = False
        try:
            slow = run(batch).logits
        finally:
            for g in graphs:
                g.ready = True
        kind = "decode" if after[0] > before[0] else "mixed"
        diffs.append((kind, fast.shape[0], (fast - slow).abs().max().item()))
        return out

    runner.run = both


def test_graph_logits_match_eager_fp32_and_greedy_is_unchanged(loaded):
    requests = [(random_ids(n, seed=n), SamplingParams(max_tokens=24 if n < 40 else 40, temperature=0, ignore_eos=True))
                for n in (1, 5, 15, 16, 17, 40)]
    eager = run_to_completion(make_engine(loaded), requests)
    engine = make_engine(loaded, compile=True)
    diffs: list[tuple[str, int, float]] = []
    _compare_paths(engine, diffs)
    assert run_to_completion(engine, requests) == eager
    assert engine.runner.graph_steps > 20
    # The six prompts prefill in one mixed step; then the batched decode graph and, at the tail, the 1-row one.
    assert {(kind, rows) for kind, rows, _ in diffs} >= {("mixed", 6), ("decode", 6), ("decode", 1)}
    assert max(d for _, _, d in diffs) < 1e-4


def test_graph_with_int4_weights_matches_eager_bf16(tmp_path):
    path = write_tiny_llama(tmp_path / "q41.gguf", TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q4_1))
    engine = make_engine(load_model(path, torch.bfloat16), dtype="bf16", compile=True)
    diffs: list[tuple[str, int, float]] = []
    _compare_paths(engine, diffs)
    requests = [(random_ids(n, seed=n), SamplingParams(max_tokens=12 + n, temperature=0, ignore_eos=True))
                for n in (3, 30)]
    run_to_completion(engine, requests)
    rows = {(kind, r) for kind, r, _ in diffs}
    # One row uses the int4 weights, two rows the dense ones.
    assert {("mixed", 2), ("decode", 2), ("decode", 1)} <= rows
    # bf16 logits of a random model are O(1); the two paths round in different places.
    assert max(d for _, _, d in diffs) < 0.1


def test_contexts_wider_than_the_graph_run_eagerly(tmp_path):
    loaded = load_model(write_tiny_llama(tmp_path / "long.gguf", TinyLlamaSpec(context_length=1024)), torch.float32)
    request = [(random_ids(MAX_BLOCKS + 4), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
    engine = make_engine(loaded, compile=True, block_size=1, max_total_tokens=4096)
    out = run_to_completion(engine, request)
    assert engine.runner.graph_steps == 0
    assert out == run_to_completion(make_engine(loaded, block_size=1, max_total_tokens=4096), request)


def test_a_failed_compile_leaves_an_eager_engine(loaded, monkeypatch, caplog):
    from tokenmill.model import decode_graph

    def broken(self):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(decode_graph.DecodeGraph, "warmup", broken)
    engine = make_engine(loaded, compile=True)
    assert engine.runner.decode_graph is None and engine.runner.step_graph is None
    assert "running it eagerly" in caplog.text
    request = [(random_ids(8), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    assert run_to_completion(engine, request) == run_to_completion(make_engine(loaded), request)


def test_a_context_shorter_than_the_warmup_batches_still_compiles(tmp_path):
    loaded = load_model(write_tiny_llama(tmp_path / "short.gguf", TinyLlamaSpec(context_length=48)), torch.float32)
    engine = make_engine(loaded, compile=True, n_ubatch=512, n_batch=512)
    assert engine.runner.step_graph is not None and engine.runner.step_graph.ready
    requests = [(random_ids(n, seed=n), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for n in (20, 30)]
    assert run_to_completion(engine, requests) == run_to_completion(make_engine(loaded), requests)
    assert engine.runner.step_graph_steps >= 1


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_graphs_match_eager_across_the_sliding_window(tmp_path, arch):
    """Gemma's local layers mask keys older than their window (8 keys here) inside both compiled
    graphs too: prompts and outputs run well past it; Gemma 2's scores are soft-capped there too."""
    from tiny_model import write_tiny_gemma2, write_tiny_gemma3
    from tiny_spm import tiny_spm_metadata

    write = write_tiny_gemma2 if arch == "gemma2" else write_tiny_gemma3
    loaded = load_model(write(tmp_path / f"{arch}.gguf", tiny_spm_metadata()), torch.float32)
    vocab = loaded.config.vocab_size
    requests = [([(7 * i + n) % (vocab - 10) + 10 for i in range(n)],
                 SamplingParams(max_tokens=12 + n, temperature=0, ignore_eos=True)) for n in (3, 20)]
    eager = run_to_completion(make_engine(loaded), requests)
    engine = make_engine(loaded, compile=True)
    diffs: list[tuple[str, int, float]] = []
    _compare_paths(engine, diffs)
    assert run_to_completion(engine, requests) == eager
    assert {("mixed", 2), ("decode", 2), ("decode", 1)} <= {(kind, rows) for kind, rows, _ in diffs}
    assert max(d for _, _, d in diffs) < 1e-4
