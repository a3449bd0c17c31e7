"""`omni bench kv`: micro-benchmarks of the prefix-cached KV cache manager.

Every workload goes through the full per-request path the scheduler uses:
build the ``Request`` (which hashes its blocks), ``get_computed_blocks``,
``allocate_slots`` and ``free``. Block size 16, token ids uniform in
[0, 128000), seeded; each number is the median over ``--repeats`` runs.

The anchors are vLLM 0.33's own ``KVCacheManager`` (xxhash option) on a
2-core machine like ours; ``speedup_vs_vllm_anchor`` > 1 means omni is faster.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Callable

from omni.engine.kv_cache import KVCacheManager
from omni.engine.request import Request

BLOCK_SIZE = 16
VOCAB = 128_000
LONG_PROMPT = 8192
NUM_SHARED_REQUESTS = 1000
SHARED_PREFIX = 384
UNIQUE_SUFFIX = 128
EVICT_POOL_BLOCKS = 600
EVICT_BATCH = 64
HASH_BLOCKS = 10_000

VLLM_ANCHOR = {
    "long_prompt_miss_us": 1900.0,
    "long_prompt_hit_us": 1700.0,
    "shared_prefix_us_per_request": 134.0,
    "shared_prefix_evict_us_per_request": 140.0,
    "hash_tokens_per_s": 15.0e6,
    "hash_tokens_per_s_full_request_path": 8.7e6,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=15,
                        help="repetitions per workload (median reported); >= 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--compare-vllm", metavar="PATH", default=None,
                        help="directory holding an importable vllm package (e.g. an unpacked wheel); "
                             "times vLLM's own KVCacheManager on the identical workloads")


def _timed(fn: Callable[[], object]) -> float:
    """Seconds for one call, with the garbage collector left on as in a running engine."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_us(setup: Callable[[], Callable[[], object]], repeats: int, per: int = 1) -> float:
    gc.collect()  # garbage of the previous workload is not billed to this one
    samples = []
    for _ in range(repeats):
        fn = setup()
        samples.append(_timed(fn))
    return statistics.median(samples) * 1e6 / per


class _Workloads:
    """Token data shared by omni and (optionally) the vLLM side."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.long_prompt = [rng.randrange(VOCAB) for _ in range(LONG_PROMPT)]
        self.long_extra = [rng.randrange(VOCAB) for _ in range(BLOCK_SIZE)]
        prefix = [rng.randrange(VOCAB) for _ in range(SHARED_PREFIX)]
        self.shared = [prefix + [rng.randrange(VOCAB) for _ in range(UNIQUE_SUFFIX)]
                       for _ in range(NUM_SHARED_REQUESTS)]
        self.hash_tokens = [rng.randrange(VOCAB) for _ in range(HASH_BLOCKS * BLOCK_SIZE)]


def _omni_one(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, block_hasher=kv.block_hasher)
    blocks, n = kv.get_computed_blocks(req)
    if kv.allocate_slots(req, req.num_tokens - n, n, blocks) is None:
        raise RuntimeError("benchmark pool too small")
    return req


def bench_omni(w: _Workloads, repeats: int) -> dict:
    def miss():
        kv = KVCacheManager(10_000, BLOCK_SIZE)
        return lambda: kv.free(_omni_one(kv, "miss", w.long_prompt))

    warm = KVCacheManager(10_000, BLOCK_SIZE)
    warm.free(_omni_one(warm, "warm", w.long_prompt))
    hit_tokens = w.long_prompt + w.long_extra

    def hit():
        return lambda: warm.free(_omni_one(warm, "hit", hit_tokens))

    def shared(num_blocks: int, batch: int):
        def setup():
            kv = KVCacheManager(num_blocks, BLOCK_SIZE)

            def body():
                live = []
                for i, toks in enumerate(w.shared):
                    live.append(_omni_one(kv, str(i), toks))
                    if len(live) == batch:
                        for r in live:
                            kv.free(r)
                        live.clear()
                for r in live:
                    kv.free(r)
            return body
        return setup

    hash_req = Request("hash", w.hash_tokens)  # no hasher: nothing hashed yet
    hasher = KVCacheManager(1, BLOCK_SIZE).block_hasher

    def hashing():
        return lambda: hasher(hash_req)

    hash_s = _median_us(hashing, repeats) / 1e6
    return {
        "long_prompt_miss_us": _median_us(miss, repeats),
        "long_prompt_hit_us": _median_us(hit, repeats),
        "shared_prefix_us_per_request": _median_us(shared(10_000, NUM_SHARED_REQUESTS + 1),
                                                   max(3, repeats // 3), NUM_SHARED_REQUESTS),
        "shared_prefix_evict_us_per_request": _median_us(shared(EVICT_POOL_BLOCKS, EVICT_BATCH),
                                                         max(3, repeats // 3), NUM_SHARED_REQUESTS),
        "hash_tokens_per_s": HASH_BLOCKS * BLOCK_SIZE / hash_s,
    }


def _speedups(ours: dict, ref: dict) -> dict:
    out = {}
    for k, v in ours.items():
        if k not in ref or not v:
            continue
        out[k] = round(v / ref[k] if k.startswith("hash_tokens_per_s") else ref[k] / v, 2)
    return out


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    w = _Workloads(args.seed)
    ours = bench_omni(w, args.repeats)
    result = {k: round(v, 1) for k, v in ours.items()}
    result["hash_tokens_per_s"] = round(ours["hash_tokens_per_s"])
    result["block_size"] = BLOCK_SIZE
    result["repeats"] = args.repeats
    result["vllm_anchor"] = dict(VLLM_ANCHOR)
    result["speedup_vs_vllm_anchor"] = _speedups(ours, VLLM_ANCHOR)
    print(f"omni KV cache manager, block size {BLOCK_SIZE}, median of {args.repeats} runs:")
    for k, v in ours.items():
        unit = "tokens/s" if k.startswith("hash") else "us"
        print(f"  {k:<40} {v:>14,.1f} {unit}   (vLLM anchor {VLLM_ANCHOR[k]:,.1f}, "
              f"x{result['speedup_vs_vllm_anchor'][k]})")
    if args.compare_vllm:
        from omni.bench import kv_vllm

        theirs = kv_vllm.bench_vllm(args.compare_vllm, w, args.repeats)
        result["vllm_measured"] = {k: round(v, 1) for k, v in theirs.items()}
        result["speedup_vs_vllm_measured"] = _speedups(ours, theirs)
        print("vLLM KVCacheManager on the identical workloads:")
        for k, v in theirs.items():
            print(f"  {k:<40} {v:>14,.1f}   (omni x{result['speedup_vs_vllm_measured'].get(k)})")
    return result
