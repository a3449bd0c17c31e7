"""Soak: the bad-input battery's pipeline (stage_configs/tiny_chain.yaml) on Ray, planned for its
workload, serving many concurrent multi-turn conversations; each stage process's resident memory stays
within the plan.

What the plan counts is the stage's own memory: weights, activations, KV blocks, tensor cache, block
pool, and the freed heap glibc keeps resident between steps (the allocator term, omni/planning/needs.py:
without it this check failed about one run in four, the thinker growing 17-27 MiB over runs for a 23 MiB
live peak). A stage process also holds its runtime (Python, torch, Ray's worker: ~700 MiB resident here),
which no plan of the stages sizes. So the check is, per stage process, what serving adds: once the
pipeline has started and served one warm-up request (a process's first forward faults in one-time
buffers; omni plan's profile step leaves them out the same way), the process's anonymous resident
memory (RssAnon: heap and tensors, what it allocates) may grow by at most the plan's total less the
weights (resident since the model loaded). Its peak is read two ways, both lower bounds of the true
peak, and the larger is checked: RssAnon sampled every 2 ms from a thread, and the resident set's
high-water mark (VmHWM, reset at the start) less the file-backed pages at the end. File-backed pages
(RssFile: shared-library code faulted in as code paths first run, +17 MiB over this soak) are the
runtime's: read-only, shared between processes, reclaimable. The budget is exactly what the workload
needs, so every planned block gets written.
"""
from __future__ import annotations

import random
import re
import threading
from pathlib import Path

import pytest

from omni import Omni, SamplingParams
from omni.config.loader import load_config
from omni.planning.plan import plan_memory
from omni.planning.profile import profile_pipeline

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CONVERSATIONS, TURNS, USER_TOKENS, MAX_TOKENS = 16, 3, 24, 8


def _status(pid: int, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) * 1024


def test_stage_processes_stay_within_the_plan(ray_cluster, store, tiny_qwen2):
    raw = load_config("stage_configs/tiny_chain.yaml").model_dump()
    raw["runtime"]["memory"] = {"budget_gb": 0.6}
    raw["runtime"]["plan"] = {"concurrent_conversations": CONVERSATIONS,
                              "context_tokens": TURNS * (USER_TOKENS + MAX_TOKENS)}
    for s in raw["stages"]:
        s["cache"] = {"block_size": 4, "memory_budget_mb": "auto"}
    cfg = load_config(raw)
    profile_pipeline(cfg, store)  # measured activations and outputs, as `omni plan` keeps them
    # A budget of exactly what the workload needs (no spare blocks that would never be touched), so the
    # check is tight: every planned block is written during the soak.
    sizing = plan_memory(cfg, store=store)
    need = sum(p.needs.fixed + max(p.wanted_blocks, p.needs.min_blocks) * p.needs.device_per_block()
               for p in sizing.stages.values())
    raw["runtime"]["memory"] = {"budget_gb": need / 2**30}
    cfg = load_config(raw)
    rng = random.Random(0)
    with Omni(cfg) as o:
        plan = o.memory_plan
        assert plan.fits and all(p.needs.activations_source == "measured by omni plan" for p in plan.stages.values())
        # One request first: a process's first forward faults in kernel code and one-time buffers that are
        # its runtime's, not the stage's (omni plan's profile step leaves them out the same way).
        assert o.generate([{"prompt_token_ids": [7] * 8}], SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
        stats = o.stats()["stages"]
        pids = {n: stats[n]["pid"] for n in plan.stages}
        start = {}
        for name, pid in pids.items():
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS, from here on
            start[name] = _status(pid, "RssAnon")
        sampled = dict(start)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.002):
                for name, pid in pids.items():
                    sampled[name] = max(sampled[name], _status(pid, "RssAnon"))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        histories = [[rng.randrange(100, 5000) for _ in range(USER_TOKENS)] for _ in range(CONVERSATIONS)]
        for turn in range(TURNS):
            outs = o.generate([{"prompt_token_ids": h} for h in histories],
                              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
            assert all(out.error is None for out in outs)
            histories = [h + list(out.outputs["thinker"].token_ids) + [rng.randrange(100, 5000) for _ in range(USER_TOKENS)]
                         for h, out in zip(histories, outs)]
        done.set()
        sampler.join()
        stats = o.stats()["stages"]
        peaks = {name: max(sampled[name], _status(pid, "VmHWM") - _status(pid, "RssFile") - _status(pid, "RssShmem"))
                 for name, pid in pids.items()}
    assert stats["thinker"]["prefix_cache_hit_rate"] > 0.3  # later turns reuse the conversation so far
    for name, p in plan.stages.items():
        grown = peaks[name] - start[name]
        allowed = p.total - p.needs.weights
        print(f"{name}: {p.num_blocks} blocks (wanted {p.wanted_blocks}), grew {grown / 2**20:.1f} MiB, "
              f"plan {allowed / 2**20:.1f} MiB (activations {p.needs.activations / 2**20:.1f} MiB, "
              f"allocator {p.needs.allocator / 2**20:.1f} MiB)")
        assert grown <= allowed, (f"stage {name}: anonymous resident memory grew by {grown / 2**20:.1f} MiB while serving; "
                                  f"the plan reserved {allowed / 2**20:.1f} MiB (activations, KV, tensor cache, pool, allocator)")
        assert stats[name]["num_blocks"] == p.num_blocks
