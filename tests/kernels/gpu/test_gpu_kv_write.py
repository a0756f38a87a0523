"""The Triton KV write (interpreted on CPU, compiled on CUDA) against its reference."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.gpu import force, kv_write, kv_write_reference


def _caches(dtype, device):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(12, 2, 24, generator=gen).to(dtype).transpose(0, 1)  # [Hkv, slots, D], strided
    v = torch.randn(2, 12, 24, generator=gen).to(dtype)
    return k.to(device), v.to(device)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_matches_the_reference_and_skips_padding_rows(device, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 3, 2, 24, generator=gen).to(dtype)  # k, v as strided slices of one projection
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([7, -1, 0, 11])
    k_cache, v_cache = _caches(cache_dtype, device)
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    kv_write_reference(k, v, want_k, want_v, slots)
    with force("triton"):
        kv_write(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))
    if dtype == cache_dtype:
        assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)
    else:  # the interpreter rounds float32 -> bfloat16 toward zero, CUDA and torch to nearest: one ulp apart
        torch.testing.assert_close(k_cache.cpu().float(), want_k.float(), atol=0, rtol=2 ** -7)
        torch.testing.assert_close(v_cache.cpu().float(), want_v.float(), atol=0, rtol=2 ** -7)
    untouched = _caches(cache_dtype, "cpu")[0]
    assert torch.equal(k_cache.cpu()[:, [1, 2, 3, 4, 5, 6, 8, 9, 10]], untouched[:, [1, 2, 3, 4, 5, 6, 8, 9, 10]])
