"""bench/head_bound.py: the one-plane head's bound holds and keeps the argmax among its candidates, on
random data and through a tiny model end to end."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from head_bound import block_l1_max, candidates, first_plane, head_weight, main  # noqa: E402
from tiny_model import TinyLlamaSpec, write_tiny_llama  # noqa: E402


def test_first_plane_is_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((5, 96)) * 3
    x1, d1, _ = first_plane(x)
    assert (np.abs(x - x1).reshape(5, 3, 32) <= d1[..., None] / 2 + 1e-12).all()


def test_the_bound_holds_and_keeps_the_argmax():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((700, 64)) * 0.05
    x = rng.standard_normal((40, 64)) * 4
    count, bound, held = candidates(x, w, block_l1_max(w))
    assert held and (bound > 0).all()
    assert ((1 <= count) & (count <= 700)).all() and count.mean() < 700


def test_a_tiny_model_end_to_end(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0))
    assert head_weight(str(path)).shape[1] == 64
    assert main(["--model", str(path), "--texts", "hello there", "the cat sat on the mat"]) == 0
    out = capsys.readouterr().out
    assert "the bound held everywhere: True" in out and "candidates p50" in out
