"""Property test: random interleavings of admissions (with shared prefixes),
chunked prefill, decode appends, preemptions, frees, lookups and resets.

After every operation ``check_integrity()`` must pass. A shadow of what each
block holds (the prefix its last slot ends) proves that every hit returns a
block with exactly the right content, i.e. no stale hit survives an eviction
or a reset, and refused allocations are checked to leave no trace.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import Request

TOKEN = st.integers(0, 2)  # tiny vocabulary on purpose: shared blocks and duplicates
IDX = st.integers(0, 63)

ADD = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.lists(TOKEN, max_size=8),
                st.sampled_from([None, None, None, "tenant"]))
SCHEDULE = st.tuples(st.just("schedule"), IDX, st.integers(1, 12))
STEP = st.tuples(st.just("step"), IDX, st.integers(1, 6), st.lists(TOKEN, min_size=1, max_size=3))
FINISH = st.tuples(st.just("finish"), IDX)
PROBE = st.tuples(st.just("probe"), st.integers(0, 2), st.integers(1, 12))
TICK = st.tuples(st.just("tick"), st.integers(1, 6), st.lists(TOKEN, min_size=1, max_size=3))
RESET = st.tuples(st.just("reset"))
OPS = st.one_of(ADD, SCHEDULE, STEP, TICK, FINISH, PROBE, RESET)


class Sim:
    def __init__(self, block_size, num_blocks, enable_caching, bases):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, hash_seed=42)
        self.bs = block_size
        self.bases = bases
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.written: dict[int, tuple] = {}  # block id -> (salt, prefix its last slot ends)
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------
    def content(self, r, block_idx):
        return (r.cache_salt, tuple(r.all_token_ids[:(block_idx + 1) * self.bs]))

    def snapshot(self):
        kv = self.kv
        return ([b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()],
                [(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks],
                {k: list(v) for k, v in kv.req_to_blocks.items()}, dict(kv.num_cached_block))

    def record(self, r, before):
        table = self.kv.req_to_blocks[r.request_id]
        for i in range(before // self.bs, r.num_computed_tokens // self.bs):
            self.written[table[i].block_id] = self.content(r, i)

    def new_request(self, tokens, salt):
        self.next_id += 1
        return Request(f"r{self.next_id}", tokens, cache_salt=salt, block_hasher=self.kv.block_hasher)

    def lookup(self, r):
        before = self.snapshot()
        blocks, n = self.kv.get_computed_blocks(r)
        assert self.snapshot() == before, "lookup must not change any state"
        assert n == len(blocks) * self.bs and n <= r.num_tokens - 1
        for i, b in enumerate(blocks):
            assert b.block_hash == r.block_hashes[i]
            assert self.written.get(b.block_id) == self.content(r, i), "stale or wrong prefix hit"
        return blocks, n, before

    def preempt(self, r):
        self.kv.free(r)
        r.num_computed_tokens = 0
        self.running.remove(r)
        self.waiting.append(r)

    # -- operations -------------------------------------------------------------
    def add(self, base, prefix_len, suffix, salt):
        tokens = self.bases[base % len(self.bases)][:prefix_len] + suffix
        if tokens:
            self.waiting.append(self.new_request(tokens, salt))

    def schedule(self, idx, chunk):
        if not self.waiting:
            return
        r = self.waiting[idx % len(self.waiting)]
        blocks, n, before = self.lookup(r)
        num_new = min(chunk, r.num_tokens - n)
        if self.kv.allocate_slots(r, num_new, n, blocks) is None:
            assert self.snapshot() == before, "a refused allocation must leave no trace"
            return
        r.num_computed_tokens = n + num_new
        r.num_cached_tokens = n
        self.record(r, n)
        self.waiting.remove(r)
        self.running.append(r)

    def step(self, idx, k, sampled):
        if not self.running:
            return
        r = self.running[idx % len(self.running)]
        if r.num_computed_tokens == r.num_tokens:  # decode: the sampled token(s) come first
            r.append_output_token_ids(sampled if len(sampled) > 1 else sampled[0])
        num_new = min(k, r.num_tokens - r.num_computed_tokens)
        before = self.snapshot()
        if self.kv.allocate_slots(r, num_new) is None:
            assert self.snapshot() == before, "a refused allocation must leave no trace"
            self.preempt(r)  # as a scheduler would: recompute later
            return
        start = r.num_computed_tokens
        r.num_computed_tokens += num_new
        self.record(r, start)

    def tick(self, k, sampled):
        """One engine step: every running request advances (or is preempted)."""
        for i in range(len(self.running) - 1, -1, -1):
            self.step(i, k, sampled)

    def finish(self, idx):
        if self.running:
            r = self.running.pop(idx % len(self.running))
            self.kv.free(r)
            self.kv.free(r)  # a second free is a no-op

    def probe(self, base, length):
        self.lookup(self.new_request(self.bases[base % len(self.bases)][:length], None))

    def reset(self):
        in_use = any(b.ref_cnt for b in self.kv.block_pool.blocks)
        before = self.snapshot()
        assert self.kv.reset_prefix_cache() is (not in_use)
        if in_use:
            assert self.snapshot() == before

    def check(self):
        self.kv.check_integrity()
        for r in self.running:
            assert len(self.kv.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // self.bs)
        for r in self.waiting:
            assert self.kv.get_block_ids(r.request_id) == []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24),
       enable_caching=st.sampled_from([True, True, True, False]),
       bases=st.lists(st.lists(TOKEN, min_size=12, max_size=12), min_size=1, max_size=3),
       ops=st.lists(OPS, min_size=25, max_size=80))
def test_random_interleavings_keep_every_invariant(block_size, num_blocks, enable_caching, bases, ops):
    sim = Sim(block_size, num_blocks, enable_caching, bases)
    sim.check()
    for name, *args in ops:
        getattr(sim, name)(*args)
        sim.check()
    for r in list(sim.running):
        sim.kv.free(r)
    kv = sim.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.reset_prefix_cache() is True
