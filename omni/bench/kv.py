"""`omni bench kv`: micro-benchmarks of the prefix-cached KV cache manager.

Every workload goes through the full per-request path the scheduler uses:
build the ``Request`` (which hashes its blocks), ``get_computed_blocks``,
``allocate_slots`` and ``free``. Block size 16, token ids uniform in
[0, 128000), seeded; each number is the median over ``--repeats`` runs.

The anchors are vLLM 0.33's own ``KVCacheManager`` (xxhash option) on a
2-core machine like ours; ``speedup_vs_vllm_anchor`` > 1 means omni is faster.
``hash_tokens_per_s`` times the full per-request hashing path (packing the
token list included) and is compared with vLLM's bare hash-function rate.

``--compare-vllm PATH`` times vLLM's own manager on the identical workloads,
side by side. vLLM stays outside the project; one way to get it::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm_dl
    python -c "import zipfile, glob; z = zipfile.ZipFile(glob.glob('/tmp/vllm_dl/*.whl')[0]); \
        [z.extract(n, '/tmp/vllm_src') for n in z.namelist() if n.endswith('.py') or '.dist-info/' in n]"
    pip install --no-deps --target /tmp/vllm_deps pyzmq msgspec cbor2 openai-harmony openai sniffio \
        pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo xgrammar apache-tvm-ffi fastapi \
        starlette partial-json-parser llguidance
    omni bench kv --compare-vllm /tmp/vllm_src:/tmp/vllm_deps
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Callable

from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import Request

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
    parser.add_argument("--repeats", type=int, default=25,
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


class _OmniBackend:
    name = "omni"

    def make(self, num_blocks: int) -> KVCacheManager:
        return KVCacheManager(num_blocks, BLOCK_SIZE)

    def admit(self, kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
        """The scheduler's per-request path: hash (in Request), look up, allocate."""
        req = Request(rid, tokens, block_hasher=kv.block_hasher)
        blocks, n = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - n, n, blocks) is None:
            raise RuntimeError("benchmark pool too small")
        return req

    def hash_setup(self, tokens: list[int]) -> Callable[[], object]:
        req = Request("hash", tokens)  # no hasher: nothing hashed yet
        hasher = KVCacheManager(1, BLOCK_SIZE).block_hasher
        return lambda: hasher(req)


class _VllmBackend:
    """vLLM's own KVCacheManager (xxhash option), imported from ``path``.

    ``path`` is one or more directories (joined with ':') that make ``vllm``
    importable, e.g. an unpacked wheel plus its pure-Python dependencies; it
    is never installed into the project. vLLM itself needs torch (for a dtype
    in its KV spec); omni's manager never imports it.
    """

    name = "vllm"

    def __init__(self, path: str) -> None:
        import importlib
        import os
        import sys

        sys.path[:0] = [p for p in path.split(":") if p]
        os.environ.setdefault("PYTHONHASHSEED", "0")  # reproducible NONE_HASH, no warning
        torch = importlib.import_module("torch")
        kvm = importlib.import_module("vllm.v1.core.kv_cache_manager")
        iface = importlib.import_module("vllm.v1.kv_cache_interface")
        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        hashing = importlib.import_module("vllm.utils.hashing")
        self._Request = importlib.import_module("vllm.v1.request").Request
        self._sp = importlib.import_module("vllm.sampling_params").SamplingParams(max_tokens=16)
        hash_fn = hashing.get_hash_fn_by_name("xxhash")
        utils.init_none_hash(hash_fn)
        self._hasher = utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self._KVCacheManager = kvm.KVCacheManager
        spec = iface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        self._config = lambda n: iface.KVCacheConfig(
            num_blocks=n, kv_cache_tensors=[], kv_cache_groups=[iface.KVCacheGroupSpec(["layer"], spec)])

    def make(self, num_blocks: int):
        return self._KVCacheManager(self._config(num_blocks), max_model_len=32768, scheduler_block_size=BLOCK_SIZE,
                                    hash_block_size=BLOCK_SIZE, enable_caching=True)

    def admit(self, kv, rid: str, tokens: list[int]):
        req = self._Request(rid, tokens, self._sp, None, block_hasher=self._hasher)
        blocks, n, _ = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - n, n, blocks) is None:
            raise RuntimeError("benchmark pool too small")
        return req

    def hash_setup(self, tokens: list[int]) -> Callable[[], object]:
        req = self._Request("hash", tokens, self._sp, None)
        return lambda: self._hasher(req)


def _bench(backend, w: _Workloads, repeats: int) -> dict:
    def miss():
        kv = backend.make(10_000)
        return lambda: kv.free(backend.admit(kv, "miss", w.long_prompt))

    warm = backend.make(10_000)
    warm.free(backend.admit(warm, "warm", w.long_prompt))
    hit_tokens = w.long_prompt + w.long_extra

    def hit():
        return lambda: warm.free(backend.admit(warm, "hit", hit_tokens))

    def shared(num_blocks: int, batch: int):
        def setup():
            kv = backend.make(num_blocks)

            def body():
                live = []
                for i, toks in enumerate(w.shared):
                    live.append(backend.admit(kv, str(i), toks))
                    if len(live) == batch:
                        for r in live:
                            kv.free(r)
                        live.clear()
                for r in live:
                    kv.free(r)
            return body
        return setup

    hash_s = _median_us(lambda: backend.hash_setup(w.hash_tokens), repeats) / 1e6
    few = max(1, repeats // 3)  # each repetition is already 1,000 requests
    return {
        "long_prompt_miss_us": _median_us(miss, repeats),
        "long_prompt_hit_us": _median_us(hit, repeats),
        "shared_prefix_us_per_request": _median_us(shared(10_000, NUM_SHARED_REQUESTS + 1), few,
                                                   NUM_SHARED_REQUESTS),
        "shared_prefix_evict_us_per_request": _median_us(shared(EVICT_POOL_BLOCKS, EVICT_BATCH), few,
                                                         NUM_SHARED_REQUESTS),
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
    ours = _bench(_OmniBackend(), w, args.repeats)
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
        theirs = _bench(_VllmBackend(args.compare_vllm), w, args.repeats)
        result["vllm_measured"] = {k: round(v, 1) for k, v in theirs.items()}
        result["speedup_vs_vllm_measured"] = _speedups(ours, theirs)
        print("vLLM KVCacheManager on the identical workloads:")
        for k, v in theirs.items():
            print(f"  {k:<40} {v:>14,.1f}   (omni x{result['speedup_vs_vllm_measured'].get(k)})")
    return result
