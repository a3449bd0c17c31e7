"""KVCacheManager behaviour, including the seed design's worked examples with
the exact block ids and free-queue order our free policy produces:

* unhashed (partial) blocks go to the HEAD of the free queue on free,
* cached blocks go to the tail in reverse block order,
* a redundant duplicate is uncached when freed (so it goes to the head).
"""

import pytest

from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import MultiModalFeature, Request


def req(kv, rid, tokens, **kw):
    return Request(rid, list(tokens), block_hasher=kv.block_hasher, **kw)


def admit(kv, r):
    """Scheduler-style admission of a whole prompt: lookup, then commit."""
    hits, n = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - n, n, hits)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
        r.num_cached_tokens = n
    kv.check_integrity()
    return [b.block_id for b in hits], None if new is None else [b.block_id for b in new]


def decode(kv, r, token):
    """Sample ``token``, then schedule it (one decode step)."""
    r.append_output_token_ids(token)
    new = kv.allocate_slots(r, 1)
    assert new is not None
    r.num_computed_tokens += 1
    kv.check_integrity()
    return [b.block_id for b in new]


def free_queue(kv):
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def cached(kv):
    return sorted(b.block_id for b in kv.block_pool.blocks if b.block_hash is not None)


def refs(kv):
    return [b.ref_cnt for b in kv.block_pool.blocks]


def free(kv, r):
    kv.free(r)
    kv.check_integrity()


A, B, C, D, E, F, G, H, I = range(1, 10)


def test_duplicated_block_example_concurrent():
    """Seed 'Duplicated blocks', request 2 sent while request 1 still runs."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = req(kv, "r1", [A, B, C, D, E, F])
    assert admit(kv, r1) == ([], [0, 1])
    assert decode(kv, r1, G) == [] and cached(kv) == [0]          # Time 0: [0 ABCD, 1 EFG]
    assert decode(kv, r1, H) == [] and cached(kv) == [0, 1]       # Time 1: EFGH full -> cached
    assert decode(kv, r1, I) == [2] and cached(kv) == [0, 1]      # Time 2: [0, 1, 2 (I)]

    r2 = req(kv, "r2", [A, B, C, D, E, F])
    assert admit(kv, r2) == ([0], [3])   # never a hit on the last prompt token: 1 block max
    decode(kv, r2, G)
    assert kv.get_block_ids("r2") == [0, 3]
    decode(kv, r2, H)
    assert cached(kv) == [0, 1, 3]       # block 3 duplicates block 1 (same hash E-H)
    assert r1.block_hashes[1] == r2.block_hashes[1]
    assert set(kv.block_pool.cached_block_hash_to_block[r1.block_hashes[1]]) == {1, 3}
    assert decode(kv, r2, I) == [4]
    assert refs(kv)[:5] == [2, 1, 1, 1, 1]

    free(kv, r1)  # 2 (partial) -> head; 1 is the now-redundant copy -> uncached, head
    assert free_queue(kv) == [1, 2, 5, 6, 7, 8, 9]
    assert cached(kv) == [0, 3]
    free(kv, r2)  # 4 (partial) -> head; then 3, 0 to the tail
    assert free_queue(kv) == [4, 1, 2, 5, 6, 7, 8, 9, 3, 0]
    assert kv.block_pool.cached_block_hash_to_block[r2.block_hashes[1]] is kv.block_pool.blocks[3]


def test_duplicated_block_example_sequential():
    """Same prompt sent twice, the first finished before the second arrives."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = req(kv, "r1", [A, B, C, D, E, F])
    admit(kv, r1)
    for t in (G, H, I):
        decode(kv, r1, t)
    assert kv.get_block_ids("r1") == [0, 1, 2]
    free(kv, r1)
    assert free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]  # partial 2 at the head, then 1, 0 kept longest

    r2 = req(kv, "r2", [A, B, C, D, E, F])
    assert admit(kv, r2) == ([0], [2])  # touched 0 leaves the queue, head 2 is reused
    decode(kv, r2, G)
    decode(kv, r2, H)
    assert set(kv.block_pool.cached_block_hash_to_block[r2.block_hashes[1]]) == {1, 2}
    assert decode(kv, r2, I) == [3]
    assert free_queue(kv) == [4, 5, 6, 7, 8, 9, 1]
    free(kv, r2)
    # The duplicate (2) vanished with its request; block 1 still serves E-H.
    assert free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert cached(kv) == [0, 1]
    r3 = req(kv, "r3", [A, B, C, D, E, F, G, H, I])
    assert kv.get_computed_blocks(r3)[1] == 8
    assert [b.block_id for b in kv.get_computed_blocks(r3)[0]] == [0, 1]


def test_ten_block_walkthrough():
    """Seed 'Example': block size 4, 10 blocks."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    p0 = list(range(100, 114))                      # 14 tokens
    r0 = req(kv, "r0", p0)
    # Time 1: 4 blocks, 3 full and cached, the 4th holds 2 of 4 tokens.
    assert admit(kv, r0) == ([], [0, 1, 2, 3])
    assert cached(kv) == [0, 1, 2] and free_queue(kv) == [4, 5, 6, 7, 8, 9]
    # Time 2-3: decoding fills block 3 (cached), then needs block 4.
    assert decode(kv, r0, 114) == []
    assert decode(kv, r0, 115) == [] and cached(kv) == [0, 1, 2, 3]
    assert decode(kv, r0, 116) == [4]

    # Time 4: 14 prompt tokens, the first 11 shared: only 2 blocks hit (the
    # third matches 3 of 4 tokens).
    p1 = p0[:11] + [900, 901, 902]
    r1 = req(kv, "r1", p1)
    assert admit(kv, r1) == ([0, 1], [5, 6])
    assert r1.num_cached_tokens == 8
    assert refs(kv) == [2, 2, 1, 1, 1, 1, 1, 0, 0, 0]
    assert cached(kv) == [0, 1, 2, 3, 5] and free_queue(kv) == [7, 8, 9]

    # Time 5: request 0 finishes. 4 (partial) -> head; 3, 2 -> tail, still cached;
    # 0 and 1 stay with request 1.
    free(kv, r0)
    assert free_queue(kv) == [4, 7, 8, 9, 3, 2]
    assert cached(kv) == [0, 1, 2, 3, 5]
    # Time 6: request 1 finishes.
    free(kv, r1)
    assert free_queue(kv) == [6, 4, 7, 8, 9, 3, 2, 5, 1, 0]
    assert refs(kv) == [0] * 10

    # Finished requests' blocks stay findable until evicted (lookup is free of side effects).
    probe = req(kv, "probe", p1)
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0]] == [0, 1, 5]
    assert free_queue(kv) == [6, 4, 7, 8, 9, 3, 2, 5, 1, 0] and refs(kv) == [0] * 10

    # Time 7: 33 prompt tokens, the first 16 equal request 0's. Hits 0-3 are
    # touched (leave the queue) BEFORE new blocks are popped from the head.
    p2 = r0.all_token_ids[:16] + list(range(500, 517))
    r2 = req(kv, "r2", p2)
    assert admit(kv, r2) == ([0, 1, 2, 3], [6, 4, 7, 8, 9])
    assert kv.get_block_ids("r2") == [0, 1, 2, 3, 6, 4, 7, 8, 9]
    assert free_queue(kv) == [5]
    assert cached(kv) == [0, 1, 2, 3, 4, 5, 6, 7, 8]   # 8 full blocks of r2 + request 1's block 5

    # Time 8: the next allocation evicts block 5 (request 1's third block).
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0]] == [0, 1, 5]
    r3 = req(kv, "r3", [7, 7, 7])
    assert admit(kv, r3) == ([], [5])
    assert 5 not in cached(kv)
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0]] == [0, 1]
    # Nothing left: the next request does not fit, and nothing changes.
    r4 = req(kv, "r4", [8, 8, 8])
    assert admit(kv, r4) == ([], None)
    assert kv.get_block_ids("r4") == []


def test_eviction_order():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    ra = req(kv, "a", range(12))             # 3 full blocks
    rb = req(kv, "b", range(50, 58))         # 2 full blocks
    admit(kv, ra)
    admit(kv, rb)
    free(kv, ra)
    free(kv, rb)
    # Never-used blocks first, then the LRU request, longest prefix first.
    assert free_queue(kv) == [5, 6, 7, 2, 1, 0, 4, 3]
    rc = req(kv, "c", range(1000, 1020))     # 5 blocks: 5, 6, 7, then evicts 2, 1
    assert admit(kv, rc) == ([], [5, 6, 7, 2, 1])
    assert [b.block_id for b in kv.get_computed_blocks(req(kv, "a2", range(13)))[0]] == [0]
    assert [b.block_id for b in kv.get_computed_blocks(req(kv, "b2", range(50, 59)))[0]] == [3, 4]


def test_shared_prefix_ref_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(10))
    r1 = req(kv, "r1", prefix + [20, 21, 22])    # 13 tokens: blocks 0,1,2 + 3
    r2 = req(kv, "r2", prefix + [30, 31, 32])
    assert admit(kv, r1) == ([], [0, 1, 2, 3])
    assert admit(kv, r2) == ([0, 1], [4, 5])     # 8 shared tokens hit
    assert refs(kv)[:6] == [2, 2, 1, 1, 1, 1]
    free(kv, r1)
    assert refs(kv)[:6] == [1, 1, 0, 0, 1, 1]
    assert free_queue(kv)[:1] == [3] and free_queue(kv)[-1] == 2
    free(kv, r2)
    assert refs(kv) == [0] * 16 and kv.num_free_blocks == 16


def test_same_batch_hit_on_blocks_cached_at_allocation():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = req(kv, "r1", range(9))
    admit(kv, r1)  # KV not computed yet, but full blocks are already cached
    r2 = req(kv, "r2", range(9))
    assert admit(kv, r2) == ([0, 1], [3])


def test_not_enough_blocks_has_no_side_effects():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    shared = list(range(8))
    r1 = req(kv, "r1", shared + [1])        # blocks 0, 1 (cached) + 2
    admit(kv, r1)
    free(kv, r1)
    r2 = req(kv, "r2", [9] * 5)             # reuses the partial block 2 first, then 3
    assert admit(kv, r2) == ([], [2, 3])
    assert free_queue(kv) == [4, 5, 1, 0]
    snapshot = (free_queue(kv), refs(kv), cached(kv), dict(kv.req_to_blocks), kv.stats())

    # 21 tokens = 6 blocks; 2 hit blocks sit in the free queue (ref 0), so they
    # count against the 4 free blocks: 4 new blocks needed, only 2 left.
    r3 = req(kv, "r3", shared + list(range(100, 113)))
    hits, n = kv.get_computed_blocks(r3)
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    before = (free_queue(kv), refs(kv), cached(kv), dict(kv.req_to_blocks))
    assert kv.allocate_slots(r3, 13, n, hits) is None
    assert (free_queue(kv), refs(kv), cached(kv), dict(kv.req_to_blocks)) == before
    assert before[:4] == snapshot[:4]
    kv.check_integrity()

    # Exactly at the boundary it fits: 16 tokens = 4 blocks, 2 hits + 2 new.
    r4 = req(kv, "r4", shared + list(range(100, 108)))
    assert admit(kv, r4) == ([0, 1], [4, 5])
    assert kv.num_free_blocks == 0


def test_last_prompt_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = req(kv, "r1", range(8))
    admit(kv, r1)
    r2 = req(kv, "r2", range(8))                  # identical, block-aligned prompt
    blocks, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0] and n == 4
    assert kv.allocate_slots(r2, 4, n, blocks) == [kv.block_pool.blocks[2]]
    kv.check_integrity()


def test_reset_prefix_cache_refused_while_in_use():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = req(kv, "r", range(9))
    admit(kv, r)
    assert kv.reset_prefix_cache() is False
    assert cached(kv) == [0, 1]                   # refused: nothing forgotten
    free(kv, r)
    assert kv.reset_prefix_cache() is True
    kv.check_integrity()
    assert cached(kv) == [] and kv.get_computed_blocks(req(kv, "again", range(9))) == ([], 0)


def test_stats_and_usage():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.stats() == {"requests": 0, "queries": 0, "hits": 0, "hit_rate": 0.0}
    r1 = req(kv, "r1", range(10))
    admit(kv, r1)
    assert kv.usage == pytest.approx(0.3)
    r2 = req(kv, "r2", range(10))
    admit(kv, r2)
    assert kv.stats() == {"requests": 2, "queries": 20, "hits": 8, "hit_rate": 0.4}
    assert r2.num_cached_tokens == 8
    free(kv, r1)
    free(kv, r2)
    assert kv.usage == 0.0


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    assert kv.block_hasher is None
    r1 = req(kv, "r1", range(10))
    assert r1.block_hashes == []                 # no hashing cost at all
    assert admit(kv, r1) == ([], [0, 1, 2])
    r2 = req(kv, "r2", range(10))
    assert admit(kv, r2) == ([], [3, 4, 5])      # identical prompt, no hit
    assert cached(kv) == [] and kv.stats()["requests"] == 0
    free(kv, r1)
    # Nothing is cached, so freed blocks go to the head in block order.
    assert free_queue(kv) == [0, 1, 2]
    free(kv, r2)
    assert free_queue(kv) == [3, 4, 5, 0, 1, 2]


def test_extra_inputs_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    toks = [1] * 13
    img = dict(mm_features=[MultiModalFeature("cat", 4, 4)])
    r1 = req(kv, "r1", toks, **img)
    admit(kv, r1)
    r2 = req(kv, "r2", toks, mm_features=[MultiModalFeature("dog", 4, 4)])
    assert admit(kv, r2)[0] == [0]               # block 0 has no image: shared
    r3 = req(kv, "r3", toks, cache_salt="other-tenant", **img)
    assert admit(kv, r3)[0] == []


def test_validation_errors():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    kv = KVCacheManager(8, 4)
    r = req(kv, "r", range(9))
    hits, n = kv.get_computed_blocks(r)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(r, -1)
    admit(kv, r)
    r2 = req(kv, "r2", range(9))
    hits, n = kv.get_computed_blocks(r2)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(r2, 1, n - 1, hits)
    r2.num_computed_tokens = n  # too early: would double-count the hits
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.allocate_slots(r2, 1, n, hits)
    r2.num_computed_tokens = 0
    r3 = req(kv, "r3", range(9))
    assert admit(kv, r3) == ([0, 1], [3])  # the refused calls left nothing behind
    kv.check_integrity()
    assert kv.get_block_ids("r2") == [] and kv.get_block_ids("unknown") == []
    kv.free(req(kv, "never-scheduled", [1]))     # no-op
    kv.check_integrity()


def test_chunked_prefill_caches_blocks_as_they_fill():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req(kv, "r", range(14))
    assert [b.block_id for b in kv.allocate_slots(r, 6)] == [0, 1]
    r.num_computed_tokens = 6
    assert cached(kv) == [0]
    assert [b.block_id for b in kv.allocate_slots(r, 6)] == [2]
    r.num_computed_tokens = 12
    assert cached(kv) == [0, 1, 2]
    assert [b.block_id for b in kv.allocate_slots(r, 2)] == [3]
    kv.check_integrity()


def test_free_with_uncache_drops_only_blocks_nobody_else_holds():
    """A failed forward pass: the failing request's blocks are uncached, except
    those another request still holds (that request computed them)."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req(kv, "a", range(1, 10))  # blocks [1..4] [5..8] [9]
    admit(kv, a)
    b = req(kv, "b", list(range(1, 9)) + [50, 51, 52, 53, 54])  # hits a's 2 full blocks, caches [50..53]
    hits, new = admit(kv, b)
    assert len(hits) == 2
    kv.free(b, uncache=True)
    kv.check_integrity()
    # a's blocks (still held by a) stay findable; b's own full block is gone.
    c = req(kv, "c", list(range(1, 9)) + [50, 51, 52, 53, 54])
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8 and [x.block_id for x in blocks] == hits
    kv.free(a)
    kv.check_integrity()
    assert kv.num_free_blocks == 10
