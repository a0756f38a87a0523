"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's K/V depends on every token before it, not only its own, so its key chains
in the parent block's key: two blocks with the same tokens after different prefixes
must never be confused.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# 16-byte digest: a collision is ~2^-64 likely even across billions of blocks, so
# a match needs no token-by-token comparison (and blocks need not keep their tokens).
BlockHash = bytes
DIGEST_SIZE = 16

# Domain tag for the first block, so "no parent" can never equal any real digest.
_ROOT = b"tokenmill-kv-root"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Key of one full block: its parent's key, its tokens, and whatever else changes
    its K/V (extra_key, e.g. a model or adapter id)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(_ROOT if parent is None else b"p" + parent)
    # Length prefixes keep the encoding unambiguous whatever extra_key holds.
    h.update(struct.pack("<I", len(extra_key)))
    h.update(extra_key)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    *,
    max_blocks: int | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of the consecutive full blocks of token_ids (a partial tail is skipped)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[BlockHash] = []
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        out.append(parent)
    return out
