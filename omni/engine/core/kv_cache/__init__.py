"""Prefix-cached paged KV cache bookkeeping (pure Python, no torch)."""

from omni.engine.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from omni.engine.core.kv_cache.hashing import BlockHash, BlockHasher, hash_block_tokens, root_hash
from omni.engine.core.kv_cache.manager import KVCacheManager

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "hash_block_tokens",
    "root_hash",
]
