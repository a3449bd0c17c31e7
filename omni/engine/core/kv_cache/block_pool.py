"""KV cache blocks, the free queue and the prefix-cache map.

Every block exists from start-up to shut-down (no Python object churn on the
hot path). A block is in exactly one of two states:

* in use:  ``ref_cnt > 0``, owned by the block tables of ``ref_cnt`` requests;
* free:    ``ref_cnt == 0``, linked into the free queue.

Orthogonally, a block may be *cached*: it holds ``block_hash`` and can be
found through ``cached_block_hash_to_block``. A free cached block keeps its
contents until it is popped for reuse (lazy eviction), so a later request
can still hit it::

               head                                                tail
    sentinel <-> [7] <-> [8] <-> [9] <-> [4]h <-> [3]h <-> [2]h <-> sentinel
                 reused first                           kept longest
                 (unhashed blocks are put here)   (cached blocks appended here)

The queue is intrusive: the links live in the blocks themselves, so removing a
block from the middle (a prefix hit on a free cached block) is O(1) and needs
no wrapper objects.
"""

from __future__ import annotations

from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Iterable, Sequence

from omni.engine.core.kv_cache.hashing import BlockHash

_is_not_none = partial(is_not, None)


class KVCacheBlock:
    """One block of ``block_size`` KV slots. Identity never changes; state does."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set when the block is full and cached; cleared on eviction/reset.
        self.block_hash: BlockHash | None = None
        # Free-queue links; both None exactly when the block is not in the queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail.

    The sentinels mean no operation ever tests for an empty neighbour: every
    real block in the queue has a real ``prev`` and ``next`` object.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.num_free_blocks = 0
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free blocks left")
        nxt = block.next_free_block
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first ``n`` blocks (the ``n`` least worth keeping), in order."""
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = [None] * n
        cur = self.head.next_free_block
        for i in range(n):
            out[i] = cur
            nxt = cur.next_free_block
            cur.prev_free_block = cur.next_free_block = None
            cur = nxt
        # One splice for the whole run: head <-> first kept block.
        self.head.next_free_block = cur
        cur.prev_free_block = self.head
        self.num_free_blocks -= n
        return out  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def remove_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        n = 0
        for block in blocks:
            prev, nxt = block.prev_free_block, block.next_free_block
            if prev is None or nxt is None:
                self.num_free_blocks -= n
                raise ValueError(f"block {block.block_id} is not in the free queue")
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            block.prev_free_block = block.next_free_block = None
            n += 1
        self.num_free_blocks -= n

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` at the tail, keeping their order (the last one ends up last)."""
        if not blocks:
            return
        last = self.tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the head, keeping their order (``blocks[0]`` is popped first)."""
        if not blocks:
            return
        first = self.head.next_free_block
        prev = self.head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail snapshot (tests, integrity checks, demos)."""
        out = []
        cur = self.head.next_free_block
        while cur is not self.tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockPool:
    """All blocks, the free queue and the hash -> block map.

    The map holds one block per hash, or ``{block_id: block}`` when several
    blocks carry the same hash. Duplicates arise because block tables are
    append-only: two requests computing the same new block at the same time
    each fill their own copy, and neither copy can be swapped out.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # Number of map keys holding a dict; lets the hot paths skip
        # duplicate handling entirely in the usual case of none.
        self._num_dup_keys = 0
        # Hashes that left the cache since the last take_evicted(), for a router that keeps
        # its own summary of what this cache holds. Bounded by one full turnover of the
        # pool: past that, "forget everything" says more than the list would.
        self._evicted: list[BlockHash] = []
        self._evicted_overflow = False

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_duplicate_keys(self) -> int:
        """Hash-map keys that hold more than one block."""
        return self._num_dup_keys

    def usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        b = self.cached_block_hash_to_block.get(block_hash)
        if b is not None and b.__class__ is dict:
            return next(iter(b.values()))
        return b

    def find_longest_hit(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Blocks for the longest prefix of ``block_hashes`` that is cached.

        ``map(dict.get)`` + ``takewhile`` keep the loop in C: a 512-block hit
        costs a few microseconds and a miss stops at the first block.
        """
        hits = list(takewhile(_is_not_none, map(self.cached_block_hash_to_block.get, block_hashes)))
        if self._num_dup_keys:
            hits = [b if b.__class__ is not dict else next(iter(b.values())) for b in hits]
        return hits

    def take_evicted(self) -> tuple[list[BlockHash], bool]:
        """Hashes no longer cached since the previous call, and whether more left than the log holds
        (or the whole cache was reset): then nothing known of this cache's contents still stands."""
        out, overflow = self._evicted, self._evicted_overflow
        self._evicted, self._evicted_overflow = [], False
        return out, overflow

    # -- state changes ---------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head, evicting cached ones, each with ref_cnt 1."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                # Lazy eviction: the block was still findable until this moment.
                self._uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the queue."""
        free = [b for b in blocks if b.ref_cnt == 0]
        if free:
            self.free_block_queue.remove_n(free)
        for b in blocks:
            b.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          start: int, end: int) -> None:
        """Cache ``blocks[start:end]`` under ``block_hashes[start:end]`` (all full, none cached yet)."""
        m = self.cached_block_hash_to_block
        setdefault = m.setdefault
        for block, h in zip(blocks[start:end], block_hashes[start:end]):
            block.block_hash = h
            other = setdefault(h, block)
            if other is not block:  # a duplicate: same prefix already cached
                if other.__class__ is dict:
                    other[block.block_id] = block
                else:
                    m[h] = {other.block_id: other, block.block_id: block}
                    self._num_dup_keys += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        ``ordered_blocks`` comes in eviction order (a request's blocks reversed):

        * cached blocks go to the tail in that order, so among blocks freed
          together the one ending the longest prefix is evicted first;
        * unhashed blocks (partial, or caching off) hold nothing reusable and
          go to the head, to be reused before any cached block;
        * a cached block whose hash another block also holds is a redundant
          copy: it is uncached and treated as unhashed, so duplicates vanish
          when their request is freed.
        """
        to_tail: list[KVCacheBlock] = []
        to_head: list[KVCacheBlock] = []
        m = self.cached_block_hash_to_block
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    to_head.append(block)
                elif self._num_dup_keys and m[block.block_hash].__class__ is dict:
                    self._uncache(block)
                    to_head.append(block)
                else:
                    to_tail.append(block)
        q = self.free_block_queue
        q.append_n(to_tail)
        if to_head:
            # Prepending one by one in eviction order == prepending the reversed
            # run: the request's first unhashed block ends up at the very head.
            to_head.reverse()
            q.prepend_n(to_head)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of `blocks`: their contents can no longer be trusted
        (e.g. the forward pass that was to fill them failed)."""
        for block in blocks:
            if block.block_hash is not None:
                self._uncache(block)

    def _uncache(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        m = self.cached_block_hash_to_block
        entry = m[h]
        if entry is block:
            del m[h]  # the last block holding this hash: the prefix is gone from the cache
            if len(self._evicted) < self.num_blocks:
                self._evicted.append(h)
            else:
                self._evicted_overflow = True
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                m[h] = next(iter(entry.values()))
                self._num_dup_keys -= 1
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        self._num_dup_keys = 0
        self._evicted, self._evicted_overflow = [], True
        for block in self.blocks:
            block.block_hash = None
        return True
