"""Block bookkeeping of the paged KV cache: which block ids hold which tokens.

The K/V tensors themselves live in kvcache.storage, indexed by these block ids.
"""
from tokenmill.kvcache.block_manager import (
    BlockManager,
    Checkpoint,
    PrefixMatch,
    PrefixStats,
    StalePrefixError,
    StateSnapshot,
)
from tokenmill.kvcache.block_pool import IntegrityError, NoFreeBlocksError
from tokenmill.kvcache.prefix_hash import BlockHash, hash_block, hash_blocks

__all__ = [
    "BlockHash",
    "BlockManager",
    "Checkpoint",
    "IntegrityError",
    "NoFreeBlocksError",
    "PrefixMatch",
    "PrefixStats",
    "StalePrefixError",
    "StateSnapshot",
    "hash_block",
    "hash_blocks",
]
