from tokenmill.kvcache import hash_block, hash_blocks
from tokenmill.kvcache.prefix_hash import DIGEST_SIZE


def test_digest_is_stable_and_sized():
    h = hash_block(None, [1, 2, 3, 4])
    assert len(h) == DIGEST_SIZE
    assert h == hash_block(None, (1, 2, 3, 4))  # list or tuple: same key


def test_every_input_changes_the_key():
    base = hash_block(None, [1, 2, 3, 4])
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, [1, 2, 3, 4]) != base
    assert hash_block(None, [1, 2, 3, 5]) != base
    assert hash_block(None, [1, 2, 3, 4], b"lora-a") != base
    assert hash_block(None, [1, 2, 3, 4], b"lora-a") != hash_block(None, [1, 2, 3, 4], b"lora-b")
    # Large ids (beyond 32 bits) are encoded in full, not truncated.
    assert hash_block(None, [1 << 40]) != hash_block(None, [0])


def test_chain_depends_on_the_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    b = hash_blocks([0, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b))  # one early token differs -> every key differs


def test_hash_blocks_skips_partial_tail_and_honours_max():
    assert len(hash_blocks([1, 2, 3, 4, 5], 2)) == 2
    assert hash_blocks([1, 2, 3, 4, 5], 2, max_blocks=1) == hash_blocks([1, 2], 2)
    h0 = hash_block(None, [1, 2])
    assert hash_blocks([1, 2, 3, 4], 2)[1] == hash_block(h0, [3, 4])
