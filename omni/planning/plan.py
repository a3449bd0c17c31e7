"""The memory plan: every device's budget split over the stage copies placed on it.

    per device:   budget
                - fixed needs of every copy there      (weights, activations, encoder cache, working memory, allocator)
                - blocks set by hand x their cost      (cache.num_blocks / a memory_budget_mb number: honoured)
                - host side of GPU stages' blocks      (tensor cache + block pool live in host RAM)
                = what the 'auto' stages share

    'auto' stage a wants w_a blocks: with runtime.plan {N conversations, T tokens}, N x ceil(T_a / block)
    for a prefix-cached stage, where T_a is the stage's own tokens per conversation (the entry stage's T,
    plus each stage's own output per turn down the graph: the talker's sequence is longer than the
    thinker's); with a budget only, max_num_seqs x ceil(max_model_len / block). Every auto stage gets
    blocks = max(min_a, floor(w_a x f)) with the one f that fills the share (binary search), so the
    rest of the budget beyond the workload is split in proportion to what each stage wants, and a
    budget short of the workload scales every stage down alike. min_a holds one max_model_len sequence.

A device whose fixed needs, hand-set blocks and the auto stages' minimum exceed its budget is
refused: MemoryPlanError naming the stage, the device, the field and the numbers. `apply` writes the
auto stages' block counts into the config the engines are built from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from omni.config.schema import PipelineConfig
from omni.config.loader import load_config
from omni.errors import MemoryPlanError
from omni.pipeline.graph import StageGraph

from omni.planning.budget import DeviceBudget, MachineProbe, device_budgets, place, real_probe
from omni.planning.needs import StageNeeds, is_auto, stage_needs, uses_plan
from omni.planning.profile_store import ProfileStore


def size(n: float) -> str:
    if abs(n) >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 or n == 0 else f"{n / 2**10:.1f} KiB"


@dataclass(slots=True)
class StagePlan:
    needs: StageNeeds
    devices: list[str]  # of each copy
    auto: bool
    num_blocks: int = 0  # per copy
    wanted_blocks: int = 0
    tokens_per_conversation: int | None = None
    verdict: str = "fits"

    @property
    def device(self) -> str:
        return self.devices[0]

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.needs.kv_per_block

    @property
    def rows_bytes(self) -> int:
        return self.num_blocks * self.needs.rows_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.needs.pool_per_block

    @property
    def total(self) -> int:
        """One copy's bytes, all devices together."""
        return self.needs.fixed + self.kv_bytes + self.rows_bytes + self.pool_bytes

    def on(self, device: str) -> int:
        """One copy's bytes on `device` ("cpu": host RAM)."""
        n = self.needs
        if device == "cpu":
            return self.total if n.device == "cpu" else self.rows_bytes + self.pool_bytes
        return n.fixed + self.kv_bytes if n.device != "cpu" else 0

    @property
    def conversations(self) -> int | None:
        """Conversations one copy keeps cached (prefix-cached stages, with a declared workload)."""
        if not self.needs.prefix_caching or not self.tokens_per_conversation:
            return None
        return self.num_blocks // -(-self.tokens_per_conversation // self.needs.block_size)


@dataclass(slots=True)
class DevicePlan:
    budget: DeviceBudget
    used: int = 0
    copies: dict[str, int] = field(default_factory=dict)  # stage -> copies on this device

    @property
    def fits(self) -> bool:
        return self.used <= self.budget.budget

    @property
    def share(self) -> float:
        return self.used / self.budget.budget if self.budget.budget else float("inf")


@dataclass(slots=True)
class MemoryPlan:
    pipeline: str
    stages: dict[str, StagePlan]
    devices: dict[str, DevicePlan]
    workload: dict[str, int] | None
    errors: list[MemoryPlanError] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.errors

    def raise_if_refused(self) -> None:
        if self.errors:
            raise self.errors[0]

    def apply(self, config: PipelineConfig) -> PipelineConfig:
        """The config with every auto stage's block count set to the plan's (the engines build exactly these)."""
        self.raise_if_refused()
        overrides = {n: {"cache": {"num_blocks": p.num_blocks, "memory_budget_mb": None}}
                     for n, p in self.stages.items() if p.auto and p.needs.autoregressive}
        return load_config(config, overrides) if overrides else config


def conversation_tokens(config: PipelineConfig, graph: StageGraph, context_tokens: int) -> dict[str, int]:
    """Each stage's own tokens for one conversation of `context_tokens` entry-stage tokens: a downstream
    stage's sequence is its input's (one position per upstream token) plus what it generates per turn."""
    out: dict[str, int] = {}
    for n in graph.order:
        ups = graph.upstream[n]
        own = config.stage(n).sampling.max_tokens or 0
        out[n] = context_tokens if not ups else max(out[u] for u in ups) + own
    return out


def _engine_default_blocks(n: StageNeeds) -> int:
    """engine_config.cache_size with neither num_blocks nor memory_budget_mb: enough for max_num_seqs
    sequences of max_model_len, within 1 GiB of KV."""
    tokens = n.max_num_seqs * (n.max_model_len or n.max_num_batched_tokens)
    return min(2**30 // max(n.kv_per_block, 1), -(-tokens // n.block_size) + 1)


def _wanted(p: StagePlan, workload: dict[str, int] | None) -> int:
    n = p.needs
    if workload is not None and p.tokens_per_conversation:
        per_conv = -(-p.tokens_per_conversation // n.block_size)
        convs = workload["concurrent_conversations"]
        return per_conv * (convs if n.prefix_caching else min(convs, n.max_num_seqs))
    return n.max_num_seqs * n.min_blocks


def _split(avail: int, items: list[tuple[StagePlan, int, int]]) -> bool:
    """Give each auto (plan, copies, cost per block) max(min, floor(wanted * f)) blocks, f as large as
    `avail` allows. False when not even the minimums fit."""
    def used(f: float) -> int:
        return sum(c * cost * max(p.needs.min_blocks, int(p.wanted_blocks * f)) for p, c, cost in items)

    if used(0.0) > avail:
        for p, _, _ in items:
            p.num_blocks = p.needs.min_blocks
        return False
    lo, hi = 0.0, 1.0
    while used(hi) <= avail and hi < 2**40:
        lo, hi = hi, hi * 2
    for _ in range(64):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if used(mid) <= avail else (lo, mid)
    for p, _, _ in items:
        p.num_blocks = max(p.needs.min_blocks, int(p.wanted_blocks * lo))
    return True


def _refusal(config: PipelineConfig, dev: DevicePlan, plans: dict[str, StagePlan], auto_min: dict[str, int],
             budget_field: str) -> MemoryPlanError:
    """Name the stage at which the device's running total (config order) passes the budget."""
    name, budget = dev.budget.name, dev.budget.budget
    running, culprit, parts = 0, None, []
    for s in config.stages:
        p = plans[s.name]
        copies = _copies(p, dev) if s.name in dev.copies else 0
        if not copies:
            continue
        one = p.on(name) if not p.auto else p.on(name) - p.num_blocks * _cost(p, name) + auto_min.get(s.name, 0)
        running += copies * one
        parts.append(f"{s.name}{f' x{copies}' if copies > 1 else ''} {size(copies * one)}")
        if culprit is None and running > budget:
            culprit = p
    culprit = culprit or max((plans[n] for n in dev.copies), key=lambda p: p.on(name))
    n = culprit.needs
    field_ = n.hand_field if not culprit.auto and n.hand_field else budget_field
    detail = (f"weights {size(n.weights)}, activations {size(n.activations)} ({n.activations_source})"
              + (f", encoder cache {size(n.encoder_cache)}" if n.encoder_cache else "")
              + (f", working memory {size(n.working)}" if n.working else "")
              + (f", allocator {size(n.allocator)}" if n.allocator else "")
              + (f", {culprit.num_blocks:,} KV blocks x {size(_cost(culprit, name))}" if n.autoregressive else ""))
    return MemoryPlanError(
        f"stage {n.stage!r} does not fit on {name}: the stages there need at least {size(running)} "
        f"({'; '.join(parts)}) but the budget is {size(budget)} ({dev.budget.source}); {n.stage}: {detail}. "
        + (f"Raise {budget_field}" if field_ == budget_field else f"Raise {budget_field} or lower {field_}")
        + " (or move a stage to another device)",
        stage=n.stage, device=name, field=field_, limit=budget, actual=running)


def _copies(p: StagePlan, dev: DevicePlan) -> int:
    """Copies of the stage whose memory lands on `dev` (the host holds every GPU copy's tensor cache)."""
    if dev.budget.name == "cpu" and p.needs.device != "cpu":
        return len(p.devices)
    return dev.copies.get(p.needs.stage, 0)


def _cost(p: StagePlan, device: str) -> int:
    return p.needs.device_per_block() if device != "cpu" or p.needs.device == "cpu" else p.needs.host_per_block()


def plan_memory(config: PipelineConfig, *, memory_gb: float | None = None, probe: MachineProbe | None = None,
                store: ProfileStore | None = None) -> MemoryPlan:
    """The arithmetic plan (nothing is loaded; activations as the profile store has them)."""
    t0 = time.perf_counter()
    probe = probe or real_probe()
    store = store if store is not None else ProfileStore()
    graph = StageGraph.of(config)
    gpus = probe.gpu_count()
    needs = [stage_needs(config, s, cuda_available=gpus > 0, store=store) for s in config.stages]
    where = place(needs, {s.name: s.resources.num_gpus for s in config.stages}, gpus)
    wl = getattr(config.runtime, "plan", None)
    workload = None if wl is None else {"concurrent_conversations": wl.concurrent_conversations,
                                        "context_tokens": wl.context_tokens}
    tokens = conversation_tokens(config, graph, wl.context_tokens) if wl is not None else {}
    planned = uses_plan(config) or memory_gb is not None
    plans: dict[str, StagePlan] = {}
    for s, n in zip(config.stages, needs):
        auto = planned and n.autoregressive and is_auto(s)
        p = StagePlan(n, where[s.name], auto, tokens_per_conversation=tokens.get(s.name) if n.autoregressive else None)
        if n.autoregressive and not auto:
            # Not planned and nothing set: the engine's own default (engine_config.cache_size), for the report.
            p.num_blocks = n.hand_blocks if n.hand_blocks is not None else _engine_default_blocks(n)
        p.wanted_blocks = _wanted(p, workload) if n.autoregressive else 0
        plans[s.name] = p
    budgets = device_budgets(config, {d for ds in where.values() for d in ds}, probe, memory_gb)
    devices = {d: DevicePlan(b) for d, b in budgets.items()}
    for name, ds in where.items():
        for d in ds:
            devices[d].copies[name] = devices[d].copies.get(name, 0) + 1
            if d != "cpu":  # the host side of a GPU copy: its tensor cache and block pool
                devices["cpu"].copies.setdefault(name, 0)
    budget_field = "--memory-gb" if memory_gb is not None else "runtime.memory.budget_gb"
    errors: list[MemoryPlanError] = []
    # GPUs first: their auto stages' block counts decide the host side of those stages.
    for d in sorted(devices, key=lambda x: x == "cpu"):
        dev = devices[d]
        fixed = 0
        autos: list[tuple[StagePlan, int, int]] = []
        for name in dev.copies:
            p = plans[name]
            copies = _copies(p, dev)
            if d == "cpu" and p.needs.device != "cpu":
                fixed += copies * p.on("cpu")  # block count already set on its GPU
            elif p.auto:
                autos.append((p, copies, _cost(p, d)))
                fixed += copies * p.needs.fixed
            else:
                fixed += copies * p.on(d)
        auto_min = {p.needs.stage: p.needs.min_blocks * cost for p, _, cost in autos}
        ok = _split(dev.budget.budget - fixed, autos) if autos else fixed <= dev.budget.budget
        dev.used = sum(_copies(plans[n], dev) * plans[n].on(d) for n in dev.copies)
        if not ok or not dev.fits:
            errors.append(_refusal(config, dev, plans, auto_min, budget_field))
            for name in dev.copies:
                plans[name].verdict = "does not fit"
    for p in plans.values():
        conv = p.conversations
        if p.verdict == "fits" and workload is not None and conv is not None \
                and conv < workload["concurrent_conversations"]:
            p.verdict = f"holds {conv} of {workload['concurrent_conversations']} conversations"
    return MemoryPlan(config.name, plans, devices, workload, errors, time.perf_counter() - t0)


def planned_config(config: PipelineConfig, *, memory_gb: float | None = None, probe: MachineProbe | None = None,
                   store: ProfileStore | None = None) -> tuple[PipelineConfig, MemoryPlan | None]:
    """What `omni run` / `omni serve` / Omni do at start-up: plan (when a budget, a workload or an 'auto'
    stage is declared), refuse a plan that does not fit (MemoryPlanError, nothing allocated), and hand on
    the config with the planned block counts."""
    if not (uses_plan(config) or memory_gb is not None):
        return config, None
    plan = plan_memory(config, memory_gb=memory_gb, probe=probe, store=store)
    return plan.apply(config), plan
