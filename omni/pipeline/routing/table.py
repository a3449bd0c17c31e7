"""The orchestrator's routing table: one Router per stage, each request's lineage, and the feedback.

    add_request      Lineage: the entry stage's token ids (given, or tokenized in the driver) or the
                     prompt's text
    submit to S      place(): keys of S from the lineage (keys.py) -> S's Router -> a replica;
                     the request counts as load there and its prefix as cached there
    S finished R     finished(): the entry stage's real token ids (+ its output) extend the lineage;
                     the hit R obtained vs the one predicted, and R's whole sequence, go into the
                     summary of the replica that served it; released()
    S's summary      cache_report(): the evictions a replica reported since its last summary
    R failed / aborted / moved to another replica   released()

Stages with one replica skip all of this but the load count (no keys are computed).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omni.messages import CacheReport, StageInput, StageOutput
from omni.pipeline.graph import StageGraph
from omni.pipeline.routing.keys import DriverTokenizer, RouteKeys, prompt_text, text_hashes, token_hashes
from omni.pipeline.routing.policy import DEFAULT_CAPACITY, Decision, Router, RouterSettings


@dataclass(slots=True)
class Placement:
    replica: int
    decision: Decision
    keys: RouteKeys | None


@dataclass(slots=True)
class Lineage:
    """What the driver knows of one request's prefix, and where its stages run."""

    tokens: list[int] | None = None  # the entry stage's: prompt, + output once it finished
    entry_done: bool = False  # `tokens` holds the entry stage's output too
    driver_tokens: list[int] | None = None  # the prompt as tokenized here (checked against the stage's)
    text: str | None = None
    cache_salt: str | None = None
    placed: dict[str, Placement] = field(default_factory=dict)  # stage -> where it runs (until released)


class PipelineRouting:
    def __init__(self, graph: StageGraph):
        self.graph = graph
        self.routers: dict[str, Router] = {}
        for name in graph.order:
            s = graph.stages[name]
            r = s.router
            capacity = r.summary_blocks or s.cache.num_blocks or DEFAULT_CAPACITY
            self.routers[name] = Router(name, s.replicas, RouterSettings(
                s.routing_policy, r.imbalance_threshold, r.min_match_ratio, capacity))
        self.primary = graph.entry_stages[0]
        self.tokenizer = DriverTokenizer(graph.stages[self.primary]) if self._needs_keys() else None
        # A downstream stage's rows follow the entry sequence position by position when its input
        # processor reads the entry stage's rows (hidden states): hit feedback then applies block by block.
        self._aligned = {n: graph.upstream[n] == [self.primary] and graph.needs_rows(n) for n in graph.order}

    def _needs_keys(self) -> bool:
        return any(r.uses_prefixes for r in self.routers.values())

    def load_tokenizer(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.load()

    # ------------------------------------------------------------ requests
    def lineage(self, request: StageInput) -> Lineage:
        lin = Lineage(cache_salt=request.cache_salt)
        if not self._needs_keys():
            return lin
        if request.prompt_token_ids is not None and not request.mm_inputs:
            lin.tokens = [int(t) for t in request.prompt_token_ids]
        elif self.tokenizer is not None:
            lin.driver_tokens = self.tokenizer.tokenize(request)
            lin.tokens = lin.driver_tokens
        if lin.tokens is None:
            lin.text = prompt_text(request)
        return lin

    def keys(self, lin: Lineage, stage: str, *, computed_only: bool = False) -> RouteKeys | None:
        """Stage `stage`'s keys of the request. Entry stage: its prompt (computed_only: once it finished,
        every token of the sequence but the last sampled one, which never went through the model).
        Downstream: the rows it is fed, one per token the entry stage computed."""
        s = self.graph.stages[stage]
        if lin.tokens is not None:
            last_fed = computed_only if stage == self.primary else lin.entry_done
            tokens = lin.tokens[:-1] if last_fed else lin.tokens
            h = token_hashes(tokens, s.cache.block_size, s.cache.hash_seed, lin.cache_salt)
            # A prompt's last token is never a hit: its logits are needed.
            aligned = stage == self.primary or self._aligned[stage]
            return RouteKeys(h, max(0, (len(tokens) - 1) // s.cache.block_size), aligned)
        if lin.text is not None:
            h = text_hashes(lin.text, lin.cache_salt)
            return RouteKeys(h, len(h), False)
        return None

    def place(self, lin: Lineage, stage: str, live: Sequence[bool], exclude: Sequence[int] = ()) -> int:
        """Choose the replica of `stage` for the request (ValueError when none is left)."""
        router = self.routers[stage]
        keys = self.keys(lin, stage) if router.uses_prefixes else None
        d = router.choose(keys.hashes if keys else None, live, exclude)
        router.started(d.replica, keys.hashes if keys else None)
        lin.placed[stage] = Placement(d.replica, d, keys)
        return d.replica

    def replica_of(self, lin: Lineage, stage: str) -> int:
        p = lin.placed.get(stage)
        return p.replica if p is not None else 0

    def released(self, lin: Lineage, stage: str) -> None:
        """The request left `stage` (finished, failed, aborted, or moving to another replica). Idempotent."""
        p = lin.placed.pop(stage, None)
        if p is not None:
            self.routers[stage].ended(p.replica)

    def finished(self, lin: Lineage, stage: str, summary: StageOutput) -> None:
        """`stage` finished the request: what it really hit, and what it caches now."""
        p = lin.placed.get(stage)
        router = self.routers[stage]
        if stage == self.primary and summary.ok and summary.prompt_token_ids and (lin.tokens or lin.text):
            if lin.driver_tokens is not None and self.tokenizer is not None:
                self.tokenizer.check(lin.driver_tokens, summary.prompt_token_ids)
            # The stage's own token ids from now on (downstream stages route by them): exact even where
            # the entry stage itself had to be routed by text.
            lin.tokens = list(summary.prompt_token_ids) + list(summary.token_ids)
            lin.entry_done = True
        if p is None or not router.uses_prefixes or not summary.ok:
            return
        bs = self.graph.stages[stage].cache.block_size
        predicted = min(p.decision.expected, p.keys.max_hit) if p.keys is not None else 0
        after = self.keys(lin, stage, computed_only=True)
        router.finished(p.replica, predicted=predicted, obtained=summary.num_cached_tokens // bs,
                        keys=after.hashes if after else None, aligned=bool(p.keys and p.keys.aligned))

    def cache_report(self, stage: str, replica: int, report: CacheReport) -> None:
        self.routers[stage].cache_report(replica, report.evicted, report.overflow)

    def replica_lost(self, stage: str, replica: int) -> None:
        """The replica died: its cache went with it."""
        self.routers[stage].forget_replica(replica)

    def stats(self, stage: str) -> dict[str, Any]:
        out = self.routers[stage].stats()
        if stage == self.primary and self.tokenizer is not None:
            out["driver_tokenizer"] = self.tokenizer.state
        return out
