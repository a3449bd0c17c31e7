"""KVCacheManager: prefix lookup, slot allocation and freeing for one stage.

The scheduler drives it with a query/commit pair per scheduling decision::

    blocks, n = kv.get_computed_blocks(req)          # query: no side effects
    new = kv.allocate_slots(req, num_new_tokens, n, blocks)
    if new is None: ...                              # no room: nothing changed
    ...
    kv.free(req)                                     # finished / preempted

One admission, block size 4, 17 prompt tokens, the first 8 a prefix hit::

    get_computed_blocks -> hits [0, 1], 8 tokens   (at most (17 - 1) // 4 = 4 blocks)
    allocate_slots(req, num_new_tokens=9, num_new_computed_tokens=8, new_computed_blocks=hits)

    tokens       0 ........ 7 | 8 .. 11 | 12 .. 15 | 16
    block table  [ 0 ][ 1 ]   |  [ 5 ]  |  [ 6 ]   | [ 7 ]
                  touched:       popped from the free-queue head
                  ref += 1,      (evicting any hash they held)
                  leave queue
    hash map     (already)    |  cached  |  cached  | partial: no hash yet

A request's block table only ever grows (the runner copies it into the
device block table incrementally), so a hit can only be taken when the
request starts, and a duplicate block computed by two requests at once stays
in both tables until they are freed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni.engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from omni.engine.core.kv_cache.hashing import BlockHasher

if TYPE_CHECKING:
    from omni.engine.core.request import Request


class KVCacheManager:
    """Paged KV block bookkeeping with automatic prefix caching (one stage, one process).

    ``enable_caching=False`` keeps the same allocator with no hasher, no
    lookups and no hash map traffic.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_seed: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        # Requests built with block_hasher=None are never hashed: with caching
        # off the manager costs no hashing at all.
        self.block_hasher: BlockHasher | None = BlockHasher(block_size, hash_seed) if self.enable_caching else None
        self.block_pool = BlockPool(num_blocks, self.enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the hash map.
        self.num_cached_block: dict[str, int] = {}
        self._stat_requests = 0
        self._stat_queries = 0
        self._stat_hits = 0

    # -- queries ---------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of blocks in use (free cached blocks count as free)."""
        return self.block_pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def stats(self) -> dict:
        q = self._stat_queries
        return {
            "requests": self._stat_requests,
            "queries": q,
            "hits": self._stat_hits,
            "hit_rate": self._stat_hits / q if q else 0.0,
        }

    def take_evicted(self) -> tuple[list[bytes], bool]:
        """Block hashes evicted since the previous call, and whether some were not logged (BlockPool)."""
        return self.block_pool.take_evicted()

    def get_computed_blocks(self, request: "Request") -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: (blocks, number of tokens they hold).

        Never covers the last token: the model must run on at least one token to
        produce the next token's logits, so at most ``(num_tokens - 1) // B``
        blocks can hit. Ref counts are untouched; ``allocate_slots`` commits.
        """
        if not self.enable_caching:
            return [], 0
        max_hit = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if len(hashes) > max_hit:
            hashes = hashes[:max_hit]
        blocks = self.block_pool.find_longest_hit(hashes)
        num_tokens = len(blocks) * self.block_size
        self._stat_requests += 1
        self._stat_queries += request.num_tokens
        self._stat_hits += num_tokens
        return blocks, num_tokens

    # -- commits -----------------------------------------------------------------
    def allocate_slots(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Slots needed in total: ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens``. ``new_computed_blocks`` are
        the prefix hits of ``get_computed_blocks`` for a request that has no
        blocks yet. Returns the newly allocated blocks (hits excluded), or
        ``None`` -- with nothing changed -- when the free queue is too short.
        Every block that becomes full is cached right away, so a request later
        in the same batch can already hit it.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"num_new_tokens ({num_new_tokens}) and num_new_computed_tokens "
                f"({num_new_computed_tokens}) must be >= 0"
            )
        bs = self.block_size
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_hit = 0
        if new_computed_blocks:
            if req_blocks:
                raise ValueError(f"request {rid!r} already has blocks; prefix hits apply to new requests only")
            if request.num_computed_tokens:
                raise ValueError(
                    f"request {rid!r}: num_computed_tokens is {request.num_computed_tokens} before its prefix "
                    f"hits were allocated; set it after allocate_slots succeeds"
                )
            num_hit = len(new_computed_blocks)
            if num_new_computed_tokens != num_hit * bs:
                raise ValueError(
                    f"num_new_computed_tokens must be len(new_computed_blocks) * block_size = "
                    f"{num_hit * bs}, got {num_new_computed_tokens}"
                )
        num_have = len(req_blocks) if req_blocks else 0
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-total_tokens // bs) - num_have - num_hit
        pool = self.block_pool
        free_queue = pool.free_block_queue

        # Hit blocks nobody uses sit in the free queue: taking them shrinks the
        # room left for new blocks just as much as allocating would.
        if num_hit:
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        else:
            num_evictable_hits = 0
        if num_new_blocks > free_queue.num_free_blocks - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if num_hit:
            # Touch hits BEFORE popping new blocks, or a free hit block could be
            # popped (and evicted) as a "new" block of this very request.
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = num_hit
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Only blocks whose tokens are all known have a hash.
            num_full = min(total_tokens, request.num_tokens) // bs
            hashes = request.block_hashes
            if num_full > len(hashes):
                num_full = len(hashes)
            num_cached = self.num_cached_block.get(rid, 0)
            if num_full > num_cached:
                pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
                self.num_cached_block[rid] = num_full
        return new_blocks

    def free(self, request: "Request", *, uncache: bool = False) -> None:
        """Release the request's blocks (last block first); unknown requests are a no-op.

        uncache=True: the request's KV may never have been written (its forward
        pass failed), yet its full blocks were cached at scheduling time. Blocks
        held by this request alone are uncached so no later request hits them;
        blocks other requests still hold were computed by them and stay.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            if uncache and self.enable_caching:
                self.block_pool.uncache_blocks(b for b in blocks if b.ref_cnt == 1)
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (and nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    # -- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant of the pool and the block tables (O(num_blocks))."""
        pool = self.block_pool
        q = pool.free_block_queue
        blocks = pool.blocks

        # Free list: links consistent in both directions, count matches.
        assert q.head.prev_free_block is None and q.tail.next_free_block is None, "sentinel links corrupted"
        free_ids: set[int] = set()
        prev = q.head
        cur = q.head.next_free_block
        while cur is not q.tail:
            assert cur is not None, "free list broken (None before tail)"
            assert cur.prev_free_block is prev, f"block {cur.block_id}: prev link does not point back"
            assert cur.block_id not in free_ids, f"block {cur.block_id} twice in the free list (cycle)"
            assert blocks[cur.block_id] is cur, f"foreign block {cur.block_id} in the free list"
            assert cur.ref_cnt == 0, f"free block {cur.block_id} has ref_cnt {cur.ref_cnt}"
            free_ids.add(cur.block_id)
            prev, cur = cur, cur.next_free_block
        assert q.tail.prev_free_block is prev, "tail sentinel prev link wrong"
        assert len(free_ids) == q.num_free_blocks, (
            f"free list holds {len(free_ids)} blocks, counter says {q.num_free_blocks}"
        )

        # Ref counts equal the number of block-table entries; in use == not free.
        refs = [0] * pool.num_blocks
        for rid, table in self.req_to_blocks.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid!r} holds a block twice: {ids}"
            for b in table:
                refs[b.block_id] += 1
            n_cached = self.num_cached_block.get(rid, 0)
            assert n_cached <= len(table), f"request {rid!r}: {n_cached} cached of {len(table)} blocks"
            for b in table[:n_cached]:
                assert b.block_hash is not None, f"request {rid!r}: block {b.block_id} should be cached"
        for rid in self.num_cached_block:
            assert rid in self.req_to_blocks, f"stale num_cached_block entry {rid!r}"
        in_use = 0
        for b in blocks:
            assert b.ref_cnt == refs[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} block-table entries"
            )
            is_free = b.block_id in free_ids
            assert is_free == (b.ref_cnt == 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, free={is_free}"
            if not is_free:
                in_use += 1
                assert b.prev_free_block is None and b.next_free_block is None, (
                    f"in-use block {b.block_id} still linked into the free list"
                )
        assert in_use + len(free_ids) == pool.num_blocks, "free + in use != total"

        # Hash map <-> block hashes, both ways.
        n_mapped = 0
        n_dup = 0
        for h, entry in pool.cached_block_hash_to_block.items():
            group = entry.values() if entry.__class__ is dict else (entry,)
            if entry.__class__ is dict:
                assert len(entry) >= 2, "duplicate group with fewer than 2 blocks"
                n_dup += 1
                assert all(bid == b.block_id for bid, b in entry.items()), "duplicate group keyed wrongly"
                assert sum(1 for b in group if b.ref_cnt == 0) <= 1, "two free copies of one cached block"
            for b in group:
                assert b.block_hash == h, f"block {b.block_id} is mapped under a hash it does not hold"
                n_mapped += 1
        assert n_dup == pool.num_duplicate_keys, f"duplicate-key counter {pool.num_duplicate_keys}, actual {n_dup}"
        n_hashed = sum(1 for b in blocks if b.block_hash is not None)
        assert n_hashed == n_mapped, f"{n_hashed} blocks hold a hash but {n_mapped} are mapped"
        if not self.enable_caching:
            assert n_hashed == 0, "caching is off but blocks hold hashes"
