import torch

from tokenmill.kvcache.storage import KVStorage


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    kv = KVStorage(n_layers=2, num_blocks=4, block_size=3, n_kv_heads=2, head_dim=5, dtype=torch.float32)
    for t in kv.k + kv.v:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in kv.k + kv.v]
    kv.copy_blocks([(1, 3), (0, 2)])
    for old, new in zip(before, kv.k + kv.v):
        assert torch.equal(new[:, 9:12], old[:, 3:6])   # block 1 -> block 3, all heads
        assert torch.equal(new[:, 6:9], old[:, 0:3])    # block 0 -> block 2
        assert torch.equal(new[:, 0:6], old[:, 0:6])    # sources untouched


def test_size_accounting():
    kv = KVStorage(n_layers=30, num_blocks=8, block_size=16, n_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert kv.nbytes == 8 * 16 * KVStorage.bytes_per_token(30, 3, 64, torch.bfloat16)
