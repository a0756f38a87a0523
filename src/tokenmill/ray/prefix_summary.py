"""The compact form in which a replica tells the router which prompt prefixes it holds, and the
match of a request against it.

A replica's prefix cache is keyed by chained block hashes (kvcache.prefix_hash): block i's key
depends on every token before it, so a request's i-th key being in a replica's cache means the
whole prefix up to that block is there. The router therefore needs no tokens and no tree, only
a set of keys per replica; 8 bytes of each 16-byte key keep the summary small (4,096 blocks =
32 KiB) at a false-match rate of ~2^-64 per lookup, harmless for a routing hint."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenmill.kvcache.prefix_hash import BlockHash, hash_blocks

KEY_BYTES = 8


def short_key(block_hash: BlockHash) -> bytes:
    return block_hash[:KEY_BYTES]


def pack(hashes: Iterable[BlockHash]) -> bytes:
    """Block hashes as one blob of short keys (what a replica publishes)."""
    return b"".join(short_key(h) for h in hashes)


def unpack(blob: bytes) -> frozenset[bytes]:
    return frozenset(blob[i:i + KEY_BYTES] for i in range(0, len(blob) - KEY_BYTES + 1, KEY_BYTES))


def request_keys(token_ids: Sequence[int], block_size: int, max_blocks: int) -> tuple[bytes, ...]:
    """Short keys of a prompt's full blocks, as the engine would key them. The engine never reuses
    the block holding the last prompt token (it must compute at least one position), so neither
    does the match."""
    usable = max(len(token_ids) - 1, 0)
    return tuple(short_key(h) for h in hash_blocks(token_ids[:usable], block_size, max_blocks=max_blocks))


def match_length(keys: Sequence[bytes], held: frozenset[bytes] | set[bytes]) -> int:
    """How many leading blocks of a request the holder has (the engine reuses only a prefix run)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


@dataclass(frozen=True)
class RoutingKey:
    """What the router knows of a request: its prompt's block keys and its session, if any."""
    blocks: tuple[bytes, ...] = ()
    session: str | None = None
