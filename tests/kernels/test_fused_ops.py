"""The fused small ops (kernels.fused) on every variant this CPU runs, and on the PyTorch path, against
their references and against the model's own layers (layers.RMSNorm, RotaryEmbedding.apply, F.silu,
F.gelu(approximate="tanh")) in fp32.

Tolerances, measured: RMSNorm differs from PyTorch only in the order of the sum of squares
(<= ~1e-6 relative; assert_close rtol 4e-6); the rotary embedding multiplies then adds as
torch.addcmul does (within 1 ulp: PyTorch contracts some of its paths to an FMA); the SIMD exp is
within 1 ulp of float64 exp; silu_mul is within ~2e-7 relative of a float64 evaluation, GELU within
1.9e-7 (1 + 2|u|) (the fp32 rounding of u = sqrt(2/pi) (g + 0.044715 g^3), amplified by exp).
GELU is computed as g / (1 + exp(-2u)), which avoids the cancellation PyTorch's 1 + tanh(u) has for
negative g, so against F.gelu part of the tolerance is absolute."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import fused, native
from tokenmill.model.layers import RMSNorm, RotaryEmbedding

VARIANTS = [*native.runnable_variants(), "torch"]
DIMS = [40, 576, 640, 1000]
TOKENS = [1, 3, 64]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread unless a test asks for more: the tests share two cores with other work, where
    thread barriers cost more than these small ops (the thread-invariance test sets its own)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    native.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
    native.set_num_threads(saved)


@pytest.fixture(params=VARIANTS)
def variant(request):
    with native.use_variant(request.param):
        yield request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rmsnorm_layer(weight: torch.Tensor, eps: float, weight_in_float32: bool) -> RMSNorm:
    layer = RMSNorm(weight.shape[0], eps, weight_in_float32=weight_in_float32)
    layer.weight.data.copy_(weight)
    return layer


# ---- RMSNorm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_layer(variant, dim, tokens):
    g = _gen(dim * 100 + tokens)
    x = torch.randn(tokens, dim, generator=g) * 3 + 0.5
    w = torch.randn(dim, generator=g)
    y = fused.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, fused.rms_norm_reference(x, w, 1e-6), rtol=4e-6, atol=1e-6)
    for weight_in_float32 in (False, True):
        torch.testing.assert_close(y, _rmsnorm_layer(w, 1e-6, weight_in_float32)(x), rtol=4e-6, atol=1e-6)


def test_rms_norm_strided_rows_and_out(variant):
    g = _gen(1)
    wide = torch.randn(7, 700, generator=g)
    x = wide[:, 3:579]  # row stride 700: a slice of a wider activation
    w = torch.rand(576, generator=g) + 0.5
    out_wide = torch.full((7, 600), 7.0)
    out = out_wide[:, :576]
    assert fused.rms_norm(x, w, 1e-5, out=out) is out
    torch.testing.assert_close(out, fused.rms_norm_reference(x, w, 1e-5), rtol=4e-6, atol=1e-6)
    assert bool((out_wide[:, 576:] == 7.0).all())
    # [T, heads, head_dim] contiguous: normalised over the last dim
    x3 = torch.randn(3, 4, 40, generator=g)
    torch.testing.assert_close(fused.rms_norm(x3, w[:40], 1e-6), fused.rms_norm_reference(x3, w[:40], 1e-6),
                               rtol=4e-6, atol=1e-6)


def test_rms_norm_other_dtypes_fall_back(variant):
    x = torch.randn(3, 64, generator=_gen(2)).bfloat16()
    w = torch.ones(64)
    y = fused.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fused.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dim", [40, 576, 1000])
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm(variant, dim, tokens):
    g = _gen(dim + tokens)
    x, residual, w = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g), torch.randn(dim)
    expected_residual = residual + x
    y = fused.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)  # one fp32 add: exact
    torch.testing.assert_close(y, _rmsnorm_layer(w, 1e-6, False)(expected_residual), rtol=4e-6, atol=1e-6)
    if variant != "torch":  # the same reduction as rms_norm: bitwise
        assert torch.equal(y, fused.rms_norm(residual, w, 1e-6))


@pytest.mark.parametrize("dim", [40, 576, 1000])
def test_rms_norm_is_batch_and_thread_invariant(variant, dim):
    g = _gen(dim)
    x, w = torch.randn(64, dim, generator=g) * 10, torch.randn(dim, generator=g)
    try:
        native.set_num_threads(2)
        whole = fused.rms_norm(x, w, 1e-6)
        res2 = x.flip(0).clone()
        added = fused.add_rms_norm(x, res2, w, 1e-6)
        native.set_num_threads(1)
        assert torch.equal(whole, fused.rms_norm(x, w, 1e-6))
        for t in (0, 1, 17, 63):
            assert torch.equal(whole[t:t + 1], fused.rms_norm(x[t:t + 1], w, 1e-6))
            assert torch.equal(whole[t:t + 3], fused.rms_norm(x[t:t + 3], w, 1e-6))
            res1 = x.flip(0)[t:t + 1].clone()
            assert torch.equal(added[t:t + 1], fused.add_rms_norm(x[t:t + 1], res1, w, 1e-6))
    finally:
        native.set_num_threads(1)


# ---- rotary embedding ----------------------------------------------------------------------------

def _qkv(tokens: int, heads: int, head_dim: int, extra: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qk as project_qkv views it: [T, heads, head_dim] inside a wider qkv row (extra = v's width)."""
    qkv = torch.randn(tokens, heads * head_dim + extra, generator=_gen(seed))
    return qkv, qkv[:, :heads * head_dim].view(tokens, heads, head_dim)


# (heads, head_dim, rope_dim): SmolLM2 (9 q + 3 k of 64), Gemma 3 270M (4 + 1 of 256), awkward ones
ROPE_SHAPES = [(12, 64, 64), (5, 256, 256), (3, 40, 40), (2, 80, 48)]


@pytest.mark.parametrize("heads,head_dim,rope_dim", ROPE_SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_qk_matches_rotary_embedding(variant, heads, head_dim, rope_dim, tokens):
    rope = RotaryEmbedding(rope_dim, 10_000.0, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=_gen(tokens))
    qkv, qk = _qkv(tokens, heads, head_dim, 3 * head_dim, seed=heads * tokens)
    before = qkv.clone()
    at = rope.at(positions, torch.float32)
    cos, sin = at.cos, at.sin
    expected = RotaryEmbedding.apply(qk[..., :rope_dim].clone(), cos, sin)
    fused.rope_qk(qk, positions, rope.cos, rope.sin)
    torch.testing.assert_close(qk[..., :rope_dim], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qk[..., rope_dim:], before[:, :heads * head_dim].view_as(qk)[..., rope_dim:])
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])  # v untouched


def test_rope_qk_position_beyond_table(variant):
    rope = RotaryEmbedding(64, 10_000.0, 16)
    _, qk = _qkv(2, 3, 64, 0, seed=4)
    with pytest.raises(IndexError):
        fused.rope_qk(qk, torch.tensor([3, 16]), rope.cos, rope.sin)


# (q heads, k heads, head_dim): Gemma 3 270M, and awkward ones
@pytest.mark.parametrize("n_q,n_k,head_dim", [(4, 1, 256), (3, 2, 40), (8, 4, 72)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_head_rms_norm_rope_matches_gemma_attention(variant, n_q, n_k, head_dim, tokens):
    g = _gen(n_q * tokens + head_dim)
    rope = RotaryEmbedding(head_dim, 1_000_000.0, 2048)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    qkv, qk = _qkv(tokens, n_q + n_k, head_dim, n_k * head_dim, seed=tokens)
    qw, kw = torch.rand(head_dim, generator=g) * 2, torch.rand(head_dim, generator=g) * 2
    q_norm, k_norm = _rmsnorm_layer(qw, 1e-6, True), _rmsnorm_layer(kw, 1e-6, True)
    at = rope.at(positions, torch.float32)
    cos, sin = at.cos, at.sin
    # Attention.project_qkv's sequence for Gemma 3
    expected = RotaryEmbedding.apply(torch.cat([q_norm(qk[:, :n_q]), k_norm(qk[:, n_q:])], dim=1), cos, sin)
    v_before = qkv[:, (n_q + n_k) * head_dim:].clone()
    fused.head_rms_norm_rope(qk, n_q, qw, kw, 1e-6, positions, rope.cos, rope.sin)
    torch.testing.assert_close(qk, expected, rtol=4e-6, atol=2e-6)
    assert torch.equal(qkv[:, (n_q + n_k) * head_dim:], v_before)


def test_head_rms_norm_rope_partial_rotary(variant):
    rope = RotaryEmbedding(24, 10_000.0, 64)
    positions = torch.tensor([0, 5, 63])
    _, qk = _qkv(3, 3, 40, 0, seed=5)
    qw, kw = torch.rand(40) + 0.5, torch.rand(40) + 0.5
    expected = qk.clone()
    fused.head_rms_norm_rope_reference(expected, 2, qw, kw, 1e-6, positions, rope.cos, rope.sin)
    fused.head_rms_norm_rope(qk, 2, qw, kw, 1e-6, positions, rope.cos, rope.sin)
    torch.testing.assert_close(qk, expected, rtol=4e-6, atol=2e-6)


# ---- gated activations and exp -------------------------------------------------------------------

def _gate_up(tokens: int, features: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    gate = torch.randn(tokens, features, generator=g) * 4
    gate.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 95.0, -95.0])  # exp's edges
    return torch.cat([gate, torch.randn(tokens, features, generator=g)], dim=1)


def _silu64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def _gelu64(gate_up: torch.Tensor) -> torch.Tensor:
    """In the sigmoid form: 0.5 g (1 + tanh(u)) cancels to 0 for g < ~-6 even in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-2 * 0.7978845608028654 * (gate + 0.044715 * gate ** 3))) * up


def _assert_close_to_torch_gelu(y: torch.Tensor, gate_up: torch.Tensor) -> None:
    """F.gelu's 1 + tanh(u) has an absolute error of ~1 ulp of 1 (relative error unbounded as it
    cancels for negative gates), so the bound has a part scaled by |g/2 * up|."""
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    bound = 4e-6 * expected.abs() + 2.5e-7 * (0.5 * gate * up).abs() + 1e-30
    assert bool(((y - expected).abs() <= bound).all()), float(((y - expected).abs() / bound).max())


@pytest.mark.parametrize("features", [37, 576, 1536, 2048])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(variant, features, tokens):
    gate_up = _gate_up(tokens, features, features + tokens)
    y = fused.silu_mul(gate_up)
    assert y.shape == (tokens, features) and y.dtype == torch.float32
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(y.double(), _silu64(gate_up), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("features", [37, 640, 2048])
@pytest.mark.parametrize("tokens", TOKENS)
def test_gelu_tanh_mul(variant, features, tokens):
    gate_up = _gate_up(tokens, features, features * tokens)
    y = fused.gelu_tanh_mul(gate_up)
    assert y.shape == (tokens, features) and y.dtype == torch.float32
    _assert_close_to_torch_gelu(y, gate_up)
    if variant != "torch":
        # fp32 rounding of u (a few ulp) is amplified by |2u| in exp(-2u): measured <= 1.9e-7 (1 + 2|u|)
        gate = gate_up[:, :features].double()
        u = 0.7978845608028654 * (gate + 0.044715 * gate ** 3)
        exact = _gelu64(gate_up)
        # (the 1e-36: exp(-2u) overflows to inf a little before g / exp(-2u) would underflow)
        assert bool(((y.double() - exact).abs() <= 4e-7 * (1 + 2 * u.abs()) * exact.abs() + 1e-36).all())


def test_gated_strided_rows(variant):
    wide = torch.randn(5, 3000, generator=_gen(6))
    gate_up = wide[:, 10:10 + 2 * 1000]
    torch.testing.assert_close(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up), rtol=2e-6, atol=1e-30)
    _assert_close_to_torch_gelu(fused.gelu_tanh_mul(gate_up), gate_up)


def _ulps(y: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|y - exact| in units of the float32 spacing at exact."""
    ref32 = exact.float()
    spacing = (torch.nextafter(ref32.abs(), torch.tensor(float("inf"))) - ref32.abs()).double()
    return (y.double() - exact).abs() / spacing


def test_exp_within_one_ulp(variant):
    x = torch.cat([torch.linspace(-87.3, 88.7, 400_001), torch.randn(100_000) * 3, torch.tensor([0.0, -0.0, 1e-30])])
    y = fused.native_exp(x)
    assert float(_ulps(y, torch.exp(x.double())).max()) <= 1.0
    # over/underflow: inf beyond ~88.72, denormals then 0 below ~-87.3, NaN stays NaN
    edge = torch.tensor([88.8, 1000.0, float("inf"), -90.0, -100.0, -104.0, -1000.0, float("-inf"), float("nan")])
    got = fused.native_exp(edge)
    assert torch.equal(got[:3], torch.full((3,), float("inf")))
    torch.testing.assert_close(got[3:8], torch.exp(edge[3:8].double()).float(), rtol=0, atol=3e-45)
    assert bool(got[8].isnan())


# ---- custom ops: schema, fake implementations, aliasing -----------------------------------------

def test_custom_ops_opcheck():
    rope = RotaryEmbedding(64, 10_000.0, 128)
    x, w = torch.randn(3, 40), torch.randn(40)
    qk = torch.randn(3, 5, 64)
    checks = [
        (fused.rms_norm_op, (x, w, 1e-6)),
        (fused.rms_norm_out_op, (x, w, 1e-6, torch.empty(3, 40))),
        (fused.add_rms_norm_op, (x, torch.randn(3, 40), w, 1e-6)),
        (fused.rope_qk_op, (qk, torch.tensor([0, 9, 127]), rope.cos, rope.sin)),
        (fused.head_rms_norm_rope_op, (qk, 4, torch.randn(64), torch.randn(64), 1e-6, torch.tensor([1, 2, 3]),
                                       rope.cos, rope.sin)),
        (fused.silu_mul_op, (torch.randn(3, 80),)),
        (fused.gelu_tanh_mul_op, (torch.randn(3, 80),)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
