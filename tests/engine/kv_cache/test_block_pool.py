import pytest

from omni.engine.core.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock


def assert_queue(q: FreeBlockQueue, expected_ids, all_blocks):
    """Check the list against ``expected_ids`` link by link, both directions,
    and that every other block is fully unlinked."""
    chain = [q.head, *(all_blocks[i] for i in expected_ids), q.tail]
    assert q.head.prev_free_block is None and q.tail.next_free_block is None
    for a, b in zip(chain, chain[1:]):
        assert a.next_free_block is b, f"{a.block_id}.next should be {b.block_id}"
        assert b.prev_free_block is a, f"{b.block_id}.prev should be {a.block_id}"
    assert len(q) == q.num_free_blocks == len(expected_ids)
    assert [b.block_id for b in q.get_all_free_blocks()] == list(expected_ids)
    members = set(expected_ids)
    for b in all_blocks:
        if b.block_id not in members:
            assert b.prev_free_block is None and b.next_free_block is None, f"{b.block_id} still linked"


@pytest.fixture
def blocks():
    return [KVCacheBlock(i) for i in range(8)]


def test_free_queue_operations(blocks):
    q = FreeBlockQueue(blocks)
    assert_queue(q, range(8), blocks)

    assert q.popleft() is blocks[0]
    assert_queue(q, [1, 2, 3, 4, 5, 6, 7], blocks)

    q.remove(blocks[4])  # middle
    assert_queue(q, [1, 2, 3, 5, 6, 7], blocks)
    q.remove(blocks[1])  # first
    q.remove(blocks[7])  # last
    assert_queue(q, [2, 3, 5, 6], blocks)

    q.append(blocks[0])
    assert_queue(q, [2, 3, 5, 6, 0], blocks)

    got = q.popleft_n(3)
    assert [b.block_id for b in got] == [2, 3, 5]
    assert_queue(q, [6, 0], blocks)

    q.append_n([blocks[7], blocks[1]])
    assert_queue(q, [6, 0, 7, 1], blocks)
    q.prepend_n([blocks[4], blocks[2]])
    assert_queue(q, [4, 2, 6, 0, 7, 1], blocks)

    q.remove_n([blocks[6], blocks[1], blocks[4]])
    assert_queue(q, [2, 0, 7], blocks)

    assert q.popleft_n(0) == [] and q.append_n([]) is None and q.prepend_n([]) is None
    assert_queue(q, [2, 0, 7], blocks)

    assert [b.block_id for b in q.popleft_n(3)] == [2, 0, 7]
    assert_queue(q, [], blocks)
    # Empty queue: prepend / append still link to the sentinels.
    q.prepend_n([blocks[3]])
    assert_queue(q, [3], blocks)
    q.popleft()
    q.append(blocks[5])
    assert_queue(q, [5], blocks)


def test_free_queue_errors(blocks):
    q = FreeBlockQueue(blocks[:2])
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert_queue(q, [0, 1], blocks)
    with pytest.raises(ValueError):
        q.remove(blocks[5])
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()


def test_pool_eviction_and_duplicates():
    pool = BlockPool(4)
    q = pool.free_block_queue
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id, a.ref_cnt, b.ref_cnt) == (0, 1, 1, 1)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"], 0, 2)
    c = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([c], [b"h1"], 0, 1)  # same content as b: duplicate
    assert pool.cached_block_hash_to_block[b"h1"] == {1: b, 2: c}
    assert pool.get_cached_block(b"h1") in (b, c)
    assert [x.block_id for x in pool.find_longest_hit([b"h0", b"h1", b"zz", b"h0"])] == [0, pool.get_cached_block(b"h1").block_id]

    # Freeing a duplicate drops the redundant copy: it goes to the head, uncached.
    pool.free_blocks([c])
    assert c.block_hash is None and pool.cached_block_hash_to_block[b"h1"] is b
    assert_queue(q, [2, 3], pool.blocks)

    pool.free_blocks([b, a])  # eviction order: b (longer prefix) first
    assert_queue(q, [2, 3, 1, 0], pool.blocks)
    assert pool.reset_prefix_cache() is True  # all free -> allowed
    assert pool.cached_block_hash_to_block == {} and all(x.block_hash is None for x in pool.blocks)
    assert_queue(q, [2, 3, 1, 0], pool.blocks)  # reset forgets hashes, not the order

    pool2 = BlockPool(3)
    x = pool2.get_new_blocks(1)[0]
    pool2.cache_full_blocks([x], [b"k"], 0, 1)
    assert pool2.reset_prefix_cache() is False  # in use
    pool2.free_blocks([x])
    # Lazy eviction: still findable while free, dropped when popped for reuse.
    assert pool2.get_cached_block(b"k") is x
    assert [y.block_id for y in pool2.get_new_blocks(3)] == [1, 2, 0]
    assert x.block_hash is None and pool2.get_cached_block(b"k") is None


def test_touch_takes_free_blocks_out_of_the_queue():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"], 0, 2)
    pool.free_blocks([b])  # b free (cached), a still in use
    pool.touch([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    assert_queue(pool.free_block_queue, [2, 3], pool.blocks)


def test_pool_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_evicted_hashes_are_logged_for_a_router():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"], 0, 2)
    c = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([c], [b"h1"], 0, 1)  # a duplicate of h1
    pool.free_blocks([c])  # the redundant copy goes: h1 is still cached (in b), nothing evicted
    assert pool.take_evicted() == ([], False)
    pool.free_blocks([b, a])
    pool.get_new_blocks(3)  # lazy eviction of both cached blocks (b first: it ends the longer prefix)
    assert pool.take_evicted() == ([b"h1", b"h0"], False)
    assert pool.take_evicted() == ([], False)  # taken once

    small = BlockPool(2)  # more evictions than the pool has blocks: the log says it overflowed
    for i in range(3):
        [x] = small.get_new_blocks(1)
        small.cache_full_blocks([x], [b"k%d" % i], 0, 1)
        small.free_blocks([x])
    small.get_new_blocks(2)
    evicted, overflow = small.take_evicted()
    assert evicted == [b"k0", b"k1"] and overflow
    assert small.reset_prefix_cache() is False  # blocks in use: refused, nothing to report
    assert small.take_evicted() == ([], False)
