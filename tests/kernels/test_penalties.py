"""The repetition penalties (kernels.penalties) on every variant this CPU runs: bitwise the torch
reference's result, which is in turn held to the rule written out one token at a time (llama.cpp's
penalties sampler). Windows with repeats, ids outside the vocabulary, empty windows, penalties of 0
and below 1, negative, zero, infinite and NaN logits, strided rows."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.penalties import apply_penalties_reference, apply_penalties_rows

VARIANTS = [*native.runnable_variants(), "torch"]


def by_hand(logits, windows, repeat, frequency, presence):
    out = logits.clone()
    for r, window in enumerate(windows):
        for t, c in Counter(window).items():
            if 0 <= t < logits.shape[1]:
                v = logits[r, t]
                rep = torch.tensor(max(repeat[r], torch.finfo(torch.float32).tiny), dtype=torch.float32)
                v = (v / rep if v > 0 else v * rep).clamp(max=torch.finfo(torch.float32).max)
                v = v - torch.tensor(float(c), dtype=torch.float32) * torch.tensor(frequency[r], dtype=torch.float32)
                out[r, t] = v - torch.tensor(presence[r], dtype=torch.float32)
    return out


def flat(windows):
    ids = torch.tensor([t for w in windows for t in w], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(w) for w in windows], dtype=torch.int64).cumsum(0)
    return ids, offsets


def run(variant, logits, windows, repeat, frequency, presence, threads=2):
    out = logits.clone()
    args = (*flat(windows), *(torch.tensor(v, dtype=torch.float32) for v in (repeat, frequency, presence)))
    native.set_num_threads(threads)
    try:
        with native.use_variant(variant):
            apply_penalties_rows(out, *args)
    finally:
        native.set_num_threads(torch.get_num_threads())
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_the_reference_and_the_rule(variant, threads):
    gen = torch.Generator().manual_seed(threads)
    rows, vocab = 21, 5000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 1e-40])
    windows = [torch.randint(-5, vocab + 5, (int(n),), generator=gen).tolist()
               for n in torch.randint(0, 200, (rows,), generator=gen)]
    windows[0] = list(range(8)) * 3
    windows[1] = []
    windows[2] = [7, 7, 7, 7]
    repeat = [1.1] * rows
    repeat[3], repeat[4], repeat[5] = 0.0, 0.5, 1e-45  # 0 and a denormal clamp to the smallest normal
    frequency = [0.0 if r % 3 else 0.25 for r in range(rows)]
    presence = [0.0 if r % 2 else 0.7 for r in range(rows)]
    got = run(variant, logits, windows, repeat, frequency, presence, threads)
    reference = logits.clone()
    apply_penalties_reference(reference, *flat(windows),
                              *(torch.tensor(v, dtype=torch.float32) for v in (repeat, frequency, presence)))
    assert torch.equal(got.nan_to_num(nan=123.0), reference.nan_to_num(nan=123.0))
    assert torch.equal(reference.nan_to_num(nan=123.0), by_hand(logits, windows, repeat, frequency, presence).nan_to_num(nan=123.0))
    assert torch.isnan(got[0, 4]) and got[0, 2] < float("inf")


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows_and_no_windows(variant):
    wide = torch.randn(3, 120, generator=torch.Generator().manual_seed(5))
    logits = wide[:, 10:110]
    windows = [[1, 2, 2], [], [99, 0]]
    expected = by_hand(logits, windows, [1.3] * 3, [0.1] * 3, [0.2] * 3)
    out = logits.clone()  # contiguous copy for the reference shape; the kernel takes the strided view
    view = wide.clone()[:, 10:110]
    args = (*flat(windows), *(torch.tensor(v, dtype=torch.float32) for v in ([1.3] * 3, [0.1] * 3, [0.2] * 3)))
    with native.use_variant(variant):
        apply_penalties_rows(view, *args)
    assert torch.equal(view, expected)
    assert torch.equal(out, logits)
    with native.use_variant(variant):
        apply_penalties_rows(out, *flat([[], [], []]), *args[2:])
    assert torch.equal(out, logits)
