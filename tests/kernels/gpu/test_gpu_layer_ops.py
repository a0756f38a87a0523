"""The decoder layer's small GPU ops (kernels/gpu/norms.py, rotary.py, activations.py; interpreted on
CPU, compiled on CUDA) against their PyTorch references, and a tiny model's decode step with every op
on its Triton kernel against the same step on the references."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.gpu import (force, gated_activation, gated_reference, residual_norm_reference,
                                   residual_rms_norm, rms_norm, rope, rope_reference)

# The interpreter rounds float32 -> bfloat16 toward zero, CUDA and torch to nearest: a bf16 result
# may sit one ulp (2^-7 relative) off, and a sum of such rounded values (|x| up to ~4 here) one ulp
# of its operands, 2^-5 absolute, even where it cancels to a small value.
BF16_RTOL, BF16_ATOL = 2 ** -6, 2 ** -5


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=BF16_RTOL, atol=BF16_ATOL)
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pre,residual,post", [(False, False, True), (False, True, True), (True, True, True),
                                               (True, True, False), (False, True, False)])
@pytest.mark.parametrize("weight_f32", [False, True])
def test_residual_norm_matches_the_reference(device, dtype, pre, residual, post, weight_f32):
    dim = 48  # not a power of two: the row's tail is masked
    a, x = _rand(5, dim, seed=1, dtype=dtype), _rand(5, dim, seed=2, dtype=dtype)
    w1, w2 = _rand(dim, seed=3, dtype=dtype) + 1, _rand(dim, seed=4, dtype=dtype) + 1
    spec_pre = (w1, 1e-6, weight_f32) if pre else None
    spec_post = (w2, 1e-5, not weight_f32) if post else None
    want_res, want_out = x.clone(), torch.empty_like(x)
    residual_norm_reference(a, want_res if residual else None, want_out if post else None, spec_pre, spec_post)
    dev = lambda t: t.to(device)  # noqa: E731
    got_res = dev(x.clone())
    with force("triton"):
        if residual:
            got = residual_rms_norm(dev(a), got_res, None if not pre else (dev(w1), 1e-6, weight_f32),
                                    None if not post else (dev(w2), 1e-5, not weight_f32))
        else:
            got = rms_norm(dev(a), dev(w2), 1e-5, not weight_f32)
    if residual:
        close(got_res, want_res)
    if post:
        close(got, want_out)
    else:
        assert got is None


def test_a_rows_norm_does_not_depend_on_the_batch(device):
    a, x, w = _rand(7, 64, seed=5), _rand(7, 64, seed=6), _rand(64, seed=7)
    with force("triton"):
        whole = residual_rms_norm(a.to(device), x.clone().to(device), None, (w.to(device), 1e-6, False))
        alone = residual_rms_norm(a[3:4].to(device), x[3:4].clone().to(device), None, (w.to(device), 1e-6, False))
    assert torch.equal(whole[3:4].cpu(), alone.cpu())


def _tables(positions: int, rope_dim: int):
    inv = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    f = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return torch.cat([f.cos(), f.cos()], -1).float(), torch.cat([-f.sin(), f.sin()], -1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_dim,head_norm", [(16, False), (12, False), (16, True)])
def test_rope_matches_the_reference(device, dtype, rope_dim, head_norm):
    tokens, n_q, n_k, hd = 4, 3, 1, 16
    qkv = _rand(tokens, n_q + 2 * n_k, hd, seed=8, dtype=dtype)  # q and k heads as a strided view of qkv
    positions = torch.tensor([0, 7, 3, 30])
    cos, sin = _tables(32, rope_dim)
    norm = (n_q, _rand(hd, seed=9, dtype=dtype) + 1, _rand(hd, seed=10, dtype=dtype) + 1, 1e-6) if head_norm else None
    want = qkv.clone()
    rope_reference(want[:, :n_q + n_k], positions, cos, sin, norm)
    got = qkv.clone().to(device)
    dev_norm = None if norm is None else (n_q, norm[1].to(device), norm[2].to(device), norm[3])
    with force("triton"):
        rope(got[:, :n_q + n_k], positions.to(device), cos.to(device), sin.to(device), dev_norm)
    close(got, want)
    assert torch.equal(got[:, n_q + n_k:].cpu(), qkv[:, n_q + n_k:])  # v heads untouched


# GELU's exp(-2u) overflows to inf for very negative inputs (g / inf = -0, the right limit); numpy,
# under the interpreter, warns where CUDA's exp is silent.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_the_reference(device, dtype, activation):
    gate_up = _rand(3, 2 * 1100, seed=11, dtype=dtype) * 3  # more features than one program's block
    want = gated_reference(gate_up, activation == "gelu_tanh")
    with force("triton"):
        got = gated_activation(gate_up.to(device), activation)
    close(got, want)


def test_ops_take_the_references_on_cpu_tensors_without_force():
    a, x, w = _rand(2, 8, seed=12), _rand(2, 8, seed=13), _rand(8, seed=14)
    got_res = x.clone()
    got = residual_rms_norm(a, got_res, None, (w, 1e-6, False))
    want_res, want = x.clone(), torch.empty_like(x)
    residual_norm_reference(a, want_res, want, None, (w, 1e-6, False))
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    with pytest.raises(ValueError):
        gated_activation(a, "relu")


@pytest.mark.parametrize("head_norm", [False, True])
def test_rope_with_the_kv_write_matches_the_references(device, head_norm):
    from tokenmill.kernels.gpu import kv_write_reference, rope_kv_write

    tokens, n_q, n_kv, hd = 3, 4, 2, 16
    qkv = _rand(tokens, n_q + 2 * n_kv, hd, seed=15, dtype=torch.bfloat16)
    positions, slots = torch.tensor([5, 0, 9]), torch.tensor([3, -1, 6])  # the second row is padding
    cos, sin = _tables(16, hd)
    norm = (n_q, _rand(hd, seed=16, dtype=torch.bfloat16) + 1, _rand(hd, seed=17, dtype=torch.bfloat16) + 1, 1e-6) \
        if head_norm else None
    k_cache = _rand(8, n_kv, hd, seed=18, dtype=torch.bfloat16).transpose(0, 1)  # [Hkv, slots, D], strided
    v_cache = _rand(n_kv, 8, hd, seed=19, dtype=torch.bfloat16)
    want, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_reference(want[:, :n_q + n_kv], positions, cos, sin, norm)
    kv_write_reference(want[:, n_q:n_q + n_kv], want[:, n_q + n_kv:], want_k, want_v, slots)
    got, got_k, got_v = qkv.clone().to(device), k_cache.clone().to(device), v_cache.clone().to(device)
    dev_norm = None if norm is None else (n_q, norm[1].to(device), norm[2].to(device), norm[3])
    with force("triton"):
        rope_kv_write(got, n_q, positions.to(device), cos.to(device), sin.to(device), dev_norm, got_k, got_v,
                      slots.to(device))
    close(got, want)
    close(got_k, want_k)
    close(got_v, want_v)
    assert torch.equal(got_k.cpu()[:, [0, 1, 2, 4, 5, 7]], k_cache[:, [0, 1, 2, 4, 5, 7]])  # slot -1: nowhere
    # the cache holds exactly the projection's rotated k rows and its v rows
    assert torch.equal(got_k.cpu()[:, 3], got.cpu()[0, n_q:n_q + n_kv])
    assert torch.equal(got_v.cpu()[:, 6], got.cpu()[2, n_q + n_kv:])
