"""qmatmul: the repack reproduces gguf's dequantization exactly, every native variant matches the
PyTorch reference (fp32 summation order apart), results are batch and thread invariant bitwise, and the
two-plane int8 activation approximation stays close to fp32 x @ W^T."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from tokenmill.kernels import native
from tokenmill.kernels.qmatmul import (SUPPORTED_TYPES, QuantizedWeight, qmatmul, qmatmul_reference,
                                       quantize_activations)

Q = gguf.GGMLQuantizationType
TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
VARIANTS = ["torch"] + native.runnable_variants()
# Native vs reference: both are fp32 sums of the same exact products in different orders, so the
# difference is bounded by a few ulps of sum |terms|.
REL_TO_ABS_SUM = 2e-6


def random_gguf(t: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [n, row_bytes] of random weights: real quantization where gguf implements it,
    else random blocks with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[t]
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        halves = lambda lo, hi: rng.uniform(lo, hi, (n, k // block, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
        if t == Q.Q4_K:
            raw[..., 0:2], raw[..., 2:4] = halves(1e-3, 2e-2), halves(1e-3, 2e-2)
        else:  # Q6_K: d is last
            raw[..., 208:210] = halves(1e-3, 2e-2)
        return raw.reshape(n, -1)


def k_for(t: Q, blocks: int) -> int:
    return gguf.GGML_QUANT_SIZES[t][0] * blocks


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 16, 37])
def test_repack_reproduces_gguf_exactly(t, n):
    k = k_for(t, 2)
    raw = random_gguf(t, n, k)
    w = QuantizedWeight.from_gguf(raw, t, (n, k))
    assert (w.out_features, w.in_features, w.ggml_type) == (n, k, t)
    np.testing.assert_array_equal(w.dequantize().numpy(), gguf.quants.dequantize(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_repacked_size_close_to_gguf(t):
    n, k = 64, k_for(t, 4)
    raw = random_gguf(t, n, k)
    assert QuantizedWeight.from_gguf(raw, t, (n, k)).nbytes <= 1.05 * raw.nbytes


def test_rejects_unsupported():
    with pytest.raises(ValueError):
        QuantizedWeight.from_gguf(np.zeros((4, 64), np.uint8), Q.Q5_1, (4, 32))
    with pytest.raises(ValueError):
        QuantizedWeight.from_gguf(np.zeros((4, 18), np.uint8), Q.Q4_0, (4, 48))


def test_activation_quantization_matches_reference():
    x = torch.randn(7, 96) * torch.rand(7, 96) * 5
    x[2, :32] = 0
    with native.use_variant("torch"):
        ref = quantize_activations(x)
    for v in VARIANTS[1:]:
        with native.use_variant(v):
            got = quantize_activations(x)
        for a, b in zip((ref.q, ref.d, ref.ds, ref.s16), (got.q, got.d, got.ds, got.s16)):
            assert torch.equal(a, b), v


def test_two_planes_round_the_residual():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 128, generator=g) * torch.rand(5, 128, generator=g) * 5
    x[1, 32:64] = 0
    a = quantize_activations(x)
    assert a.q.shape == (5, 2, 128) and a.d.shape == (5, 4)
    # fp32 rounding of the residual x - d1 q1 is ~1e-3 of a fine step: bounds get 1% of a step
    step = a.d.repeat_interleave(32, 1)  # the fine plane's grid
    coarse = a.q[:, 0].float() * step * 128
    # the first plane is within half its step (128 fine steps) of x, the fine plane takes the rest
    assert ((x - coarse).abs() <= 64.01 * step).all()
    assert ((x - coarse).abs() > 0.5 * step).any()
    assert ((a.dequantize() - x).abs() <= 0.51 * step).all()
    assert int(a.q[:, 1].abs().max()) <= 64
    # so the activations are within half of absmax / (127 * 128) of x: ~3e-5 of the block's largest value
    amax = x.abs().view(5, 4, 32).amax(-1).repeat_interleave(32, 1)
    assert ((a.dequantize() - x).abs() <= 0.51 / (127 * 128) * amax).all()
    assert bool((a.d[1, 1] == 0).all()) and bool((a.q[1, :, 32:64] == 0).all())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("several", [False, True])
def test_native_matches_reference(variant, t, several):
    blocks = (2 if t in (Q.Q4_K, Q.Q6_K) else 5) if several else 1
    n, k = 37, k_for(t, blocks)
    w = QuantizedWeight.from_gguf(random_gguf(t, n, k, seed=blocks), t, (n, k))
    wd = w.dequantize()
    for m in (1, 3, 8, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        with native.use_variant(variant):
            got = qmatmul(x, w)
        ref = qmatmul_reference(x, w)
        xq = quantize_activations(x).dequantize()
        bound = REL_TO_ABS_SUM * (xq.abs() @ wd.abs().T) + 1e-30
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert ((got - ref).abs() <= bound).all(), f"{variant} {t.name} m={m}: {(got - ref).abs().max()}"
        # the activation rounding is the only approximation: close to the fp32 product
        exact = x @ wd.T
        assert (got - exact).norm() <= 1e-4 * exact.norm()


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_batch_and_thread_invariance(variant, t):
    # 53 outputs: three whole tiles and a partial one. At 3+ rows AVX-512 takes whole tiles two at a
    # time where a thread's range allows (tiles 0-1) and the others one at a time.
    n, k = 53, k_for(t, 2)
    w = QuantizedWeight.from_gguf(random_gguf(t, n, k), t, (n, k))
    x = torch.randn(37, k)
    with native.use_variant(variant):
        full = qmatmul(x, w)
        for i in (0, 5, 36):
            assert torch.equal(qmatmul(x[i:i + 1], w), full[i:i + 1])
        assert torch.equal(qmatmul(x[3:11], w), full[3:11])
        assert torch.equal(qmatmul(x[7:9], w), full[7:9])  # the two-row GEMV
        other = torch.cat([x[20:21], torch.randn(4, k) * 100])
        assert torch.equal(qmatmul(other, w)[0], full[20])
        try:
            native.set_num_threads(1)
            one = qmatmul(x, w)
            native.set_num_threads(2)
            two = qmatmul(x, w)
        finally:
            native.set_num_threads(torch.get_num_threads())
        assert torch.equal(one, full) and torch.equal(two, full)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_few_rows_give_each_row_its_bits_alone(variant, t):
    """1 to 14 rows: groups of three, with a row left over joining one as a group of four (4, 7, 10,
    13 rows), two left over either running as a group of their own over the same tiles (5 rows) or
    joining two groups as two of four (8, 11, 14): each row bitwise what it gives alone, whether AMX
    takes the full call or not."""
    n, k, most = 53, k_for(t, 3), 14
    w = QuantizedWeight.from_gguf(random_gguf(t, n, k, seed=7), t, (n, k))
    x = torch.randn(most, k, generator=torch.Generator().manual_seed(3))
    with native.use_variant(variant):
        alone = torch.cat([qmatmul(x[i:i + 1], w) for i in range(most)])
        for m in range(2, most + 1):
            assert torch.equal(qmatmul(x[:m], w), alone[:m]), f"{m} rows"
            assert torch.equal(qmatmul(x[most - m:], w), alone[most - m:]), f"the last {m} rows"


def _amx_runs() -> bool:
    with native.use_variant(native.variant()), native.use_amx(True) as on:
        return on


@pytest.mark.skipif(not _amx_runs(), reason="this CPU (or build) has no AMX-INT8")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_amx_gives_the_vnni_kernels_bits(t, blocks):
    """AMX takes whole groups of 16 rows (the rest stay on VNNI) and must give the same bits: one
    block and two (the two-deep pipeline's edges), a partial tile, tails, 1 or 2 threads. Q6_K is
    not an AMX type: turning AMX on must leave it alone."""
    n, k = 53, k_for(t, min(blocks, 2) if t in (Q.Q4_K, Q.Q6_K) else blocks)
    w = QuantizedWeight.from_gguf(random_gguf(t, n, k, seed=blocks), t, (n, k))
    passes = native.module().amx_passes
    for m in (16, 37, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        with native.use_amx(False):
            before = passes()
            vnni = qmatmul(x, w)
            assert passes() == before
        try:
            for threads in (1, 2):
                native.set_num_threads(threads)
                with native.use_amx(True):
                    before = passes()
                    assert torch.equal(qmatmul(x, w), vnni), f"{t.name} m={m} threads={threads}"
                    assert passes() > before or t == Q.Q6_K  # it did run on AMX (Q6_K stays on VNNI)
        finally:
            native.set_num_threads(torch.get_num_threads())
    with native.use_amx(True):  # a row alone (VNNI) and inside an AMX group
        assert torch.equal(qmatmul(x[40:41], w), qmatmul(x[32:64], w)[8:9])


@pytest.mark.skipif(not _amx_runs(), reason="this CPU (or build) has no AMX-INT8")
def test_amx_vocabulary_wide_output():
    # A head this wide streams from memory: AMX takes it from 48 rows (kAmxWideRows), below on VNNI.
    n, k = 16384 + 8, 64
    w = QuantizedWeight.from_gguf(random_gguf(Q.Q8_0, n, k), Q.Q8_0, (n, k))
    for m, takes_amx in ((20, False), (47, False), (50, True)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        with native.use_amx(False):
            vnni = qmatmul(x, w)
        with native.use_amx(True):
            before = native.module().amx_passes()
            lines = torch.full((m, n + 8), float("nan"))
            amx = qmatmul(x, w, out=lines[:, :n])
            assert (native.module().amx_passes() > before) == takes_amx, m
        assert torch.equal(amx, vnni) and lines[:, n:].isnan().all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_column_slice_and_shared_activations(variant):
    k = 256
    parts = [(Q.Q5_0, 24), (Q.Q8_0, 8), (Q.Q4_K, 19)]
    ws = [QuantizedWeight.from_gguf(random_gguf(t, n, k), t, (n, k)) for t, n in parts]
    x = torch.randn(5, k)
    with native.use_variant(variant):
        a = quantize_activations(x)
        fused = torch.full((5, 60), float("nan"))
        col = 0
        for w in ws:
            qmatmul(a, w, out=fused[:, col:col + w.out_features])
            col += w.out_features
        separate = torch.cat([qmatmul(x, w) for w in ws], 1)
    assert torch.equal(fused[:, :51], separate)
    assert fused[:, 51:].isnan().all()


@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_vocabulary_wide_outputs_match_narrow_ones(variant):
    """From 16384 columns the AVX-512 kernel writes whole aligned lines with streaming stores (partial
    tiles and unaligned outputs the ordinary way): the same values, wherever out lies."""
    n, k = 16384 + 8, 64  # the last tile half full
    w = QuantizedWeight.from_gguf(random_gguf(Q.Q8_0, n, k), Q.Q8_0, (n, k))
    tail = QuantizedWeight.from_gguf(random_gguf(Q.Q8_0, n, k)[-40:], Q.Q8_0, (40, k))  # narrow: 40 columns
    x = torch.randn(7, k)
    with native.use_variant(variant):
        lines = torch.full((7, n + 8), float("nan"))  # rows of whole lines: streamed
        wide = qmatmul(x, w, out=lines[:, :n])
        shifted = torch.full((7, n + 1), float("nan"))
        qmatmul(x, w, out=shifted[:, 1:])  # rows 4 bytes off a line: ordinary stores
        narrow = qmatmul(x, tail)
    assert torch.equal(wide[:, -40:], narrow)
    assert torch.equal(shifted[:, 1:], wide) and shifted[:, 0].isnan().all() and lines[:, n:].isnan().all()
    ref = qmatmul_reference(x, w)
    assert (wide - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_compiles_without_graph_break():
    k = 64
    w = QuantizedWeight.from_gguf(random_gguf(Q.Q4_1, 20, k), Q.Q4_1, (20, k))
    x = torch.randn(3, k)
    compiled = torch.compile(lambda x: qmatmul(x, w) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), qmatmul(x, w) * 2)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", [0xFF, 0x80])
def test_extreme_values_do_not_saturate(variant, t, fill):
    """Largest weights (every value bit set; Q8_0 also -128) times activations of +-127 everywhere:
    the worst case for AVX2's int16 maddubs sums (a whole block of 4-bit steps in int16)."""
    n, k = 16, k_for(t, 1)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = np.full((n, k // block, size), fill, np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    scale_at = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}.get(t, (0, 2) if t == Q.Q4_1 else (0,))
    for at in scale_at:
        raw[..., at:at + 2] = one
    w = QuantizedWeight.from_gguf(raw.reshape(n, -1), t, (n, k))
    x = torch.ones(8, k)  # 8 rows: the AVX2 kernel's decoded-tile path too
    x[1::2] = -1
    with native.use_variant(variant):
        got = qmatmul(x, w)
    ref = qmatmul_reference(x, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)
