"""Router: picks one replica of a stage for each request.

    round_robin       the next live replica in turn
    least_loaded      the live replica with the fewest requests in flight (ties rotate)
    prefix_affinity   (as Ray Serve's PrefixCacheAffinityRouter, falling back to load)
        1. load spread = max - min requests in flight over the live replicas
           > imbalance_threshold  -> power of two choices: the less loaded of two
                                     random live replicas                       "imbalance"
        2. per live replica, the longest prefix of the request's block hashes
           found in the router's summary of that replica
           best < min_match_ratio of the request's blocks
                                  -> power of two choices                      "short_match"
        3. the replicas with the best match; the least loaded of them          "affinity"

A replica's *summary* is what the router believes its prefix cache holds: the block
hashes of the requests it was sent (recorded when routed, and again, over the whole
sequence, when they finish), least recently used forgotten first past `capacity`.
A block recorded by a finished request is *confirmed*: the replica computed it and keeps
it until it reports it evicted. One recorded only by a request still in flight is not: a
request that follows it there hits it only if it is scheduled after that block is computed,
not in the same step, which depends on when it reaches the replica. The hit the router
*predicts* (and checks) is the confirmed part of the match; routing uses the whole match, so
requests sharing a prefix in flight still go together.
What the replicas report corrects it:

    evicted block hashes  (CacheReport on a finished request's summary)  -> forgotten
    overflow / reset                                                      -> summary cleared
    hits obtained < predicted (num_cached_tokens of a finished request)   -> the summary
        believed more than the cache held: its least recently used blocks are forgotten,
        as many as the shortfall

Load is the router's own count of requests in flight per replica (routed, not yet
finished, failed or aborted): it moves with every decision, with no round trip.
A replica that is not live (dead, or restarting after a crash) gets nothing while
another one is live. Everything here is plain Python: no Ray, no tensors.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY = 4096  # summary blocks per replica when the stage's cache size is not configured

REASONS = ("affinity", "short_match", "imbalance", "least_loaded", "round_robin")


@dataclass(slots=True)
class RouterSettings:
    policy: str = "prefix_affinity"  # prefix_affinity | least_loaded | round_robin
    imbalance_threshold: int = 4
    min_match_ratio: float = 0.5
    capacity: int = DEFAULT_CAPACITY  # blocks remembered per replica


@dataclass(slots=True)
class Decision:
    replica: int
    reason: str  # one of REASONS
    matched: int = 0  # blocks the chosen replica is believed to hold or to be computing
    expected: int = 0  # of those, the confirmed ones (a finished request left them): the predicted hit


class ReplicaSummary:
    """The block hashes one replica is believed to cache; an LRU (most recent last). Each hash maps to
    whether it is confirmed (recorded by a finished request)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: OrderedDict[bytes, bool] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def match(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of `keys` held (chained hashes: a lookup stops at the first miss)."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def confirmed(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of `keys` held and confirmed."""
        n = 0
        for k in keys:
            if not self._lru.get(k, False):
                break
            n += 1
        return n

    def record(self, keys: Sequence[bytes], confirmed: bool = False) -> None:
        """`keys` are cached now, or being computed (`confirmed` False: a request in flight); most recently
        used. A confirmed hash stays confirmed. The least recently used go past capacity."""
        lru = self._lru
        for k in keys:
            lru[k] = confirmed or lru.get(k, False)
            lru.move_to_end(k)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> int:
        """Drop `keys`; how many were held."""
        n = 0
        for k in keys:
            if k in self._lru:
                del self._lru[k]
                n += 1
        return n

    def trim(self, n: int) -> None:
        """Forget the `n` least recently used blocks."""
        for _ in range(min(n, len(self._lru))):
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


@dataclass(slots=True)
class _Counters:
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    predicted_blocks: int = 0  # summed over finished requests: the hit the router expected
    obtained_blocks: int = 0  # ... and the hit the replica reported
    shortfalls: int = 0  # finished requests that hit less than predicted
    evictions: int = 0  # evicted hashes the replicas reported that the router still held
    resets: int = 0  # summaries cleared on an overflowing or reset cache


class Router:
    """One stage's replica choice. Not thread-safe: the orchestrator calls it under its lock."""

    def __init__(self, stage: str, num_replicas: int, settings: RouterSettings, seed: int = 0):
        if num_replicas < 1:
            raise ValueError(f"stage {stage!r}: replicas must be >= 1, got {num_replicas}")
        self.stage = stage
        self.settings = settings
        self.num_replicas = num_replicas
        self.load = [0] * num_replicas  # requests in flight, by the router's count
        self.summaries = [ReplicaSummary(settings.capacity) for _ in range(num_replicas)]
        self._rng = random.Random(f"{stage}:{seed}")  # reproducible choices
        self._turn = 0  # round robin position / least-loaded tie rotation
        self.counters = _Counters()

    @property
    def uses_prefixes(self) -> bool:
        return self.settings.policy == "prefix_affinity" and self.num_replicas > 1

    # ------------------------------------------------------------ decisions
    def choose(self, keys: Sequence[bytes] | None, live: Sequence[bool], exclude: Sequence[int] = ()) -> Decision:
        """The replica for a request whose prefix is `keys` (None: unknown). `live[i]`: replica i serves now.
        Replicas in `exclude` are never chosen; without a live one, any other is (the backend holds the
        request until it is back). ValueError when every replica is excluded."""
        candidates = [i for i in range(self.num_replicas) if live[i] and i not in exclude]
        if not candidates:
            candidates = [i for i in range(self.num_replicas) if i not in exclude]
        if not candidates:
            raise ValueError(f"stage {self.stage!r}: no replica left to send the request to")
        policy = self.settings.policy
        if len(candidates) == 1:
            d = Decision(candidates[0], "least_loaded" if policy != "round_robin" else "round_robin")
        elif policy == "round_robin":
            d = Decision(self._round_robin(candidates), "round_robin")
        elif policy == "least_loaded":
            d = Decision(self._least_loaded(candidates), "least_loaded")
        else:
            d = self._affinity(keys or (), candidates)
        self.counters.decisions[d.reason] += 1
        return d

    def _round_robin(self, candidates: list[int]) -> int:
        self._turn += 1
        return candidates[(self._turn - 1) % len(candidates)]

    def _least_loaded(self, candidates: list[int]) -> int:
        low = min(self.load[i] for i in candidates)
        tied = [i for i in candidates if self.load[i] == low]
        self._turn += 1
        return tied[(self._turn - 1) % len(tied)]

    def _two_choices(self, candidates: list[int]) -> int:
        a, b = self._rng.sample(candidates, 2)
        if self.load[a] == self.load[b]:
            return self._least_loaded([a, b])
        return a if self.load[a] < self.load[b] else b

    def _affinity(self, keys: Sequence[bytes], candidates: list[int]) -> Decision:
        loads = [self.load[i] for i in candidates]
        if max(loads) - min(loads) > self.settings.imbalance_threshold:
            return Decision(self._two_choices(candidates), "imbalance")
        matches = {i: self.summaries[i].match(keys) for i in candidates}
        best = max(matches.values())
        if not keys or best == 0 or best < self.settings.min_match_ratio * len(keys):
            r = self._two_choices(candidates)
            reason = "short_match"
        else:
            r = self._least_loaded([i for i in candidates if matches[i] == best])
            reason = "affinity"
        expected = self.summaries[r].confirmed(keys)
        return Decision(r, reason, matches[r], expected)

    # ------------------------------------------------------------ feedback
    def started(self, replica: int, keys: Sequence[bytes] | None) -> None:
        """A request was sent to `replica`: it counts as load, and its prefix as being computed there
        (so that requests sharing it, routed before it finishes, follow it; not confirmed)."""
        self.load[replica] += 1
        if keys and self.uses_prefixes:
            self.summaries[replica].record(keys)

    def ended(self, replica: int) -> None:
        """The request sent to `replica` finished, failed or was aborted there."""
        self.load[replica] = max(0, self.load[replica] - 1)

    def finished(self, replica: int, *, predicted: int, obtained: int | None, keys: Sequence[bytes] | None,
                 aligned: bool) -> None:
        """A request finished on `replica`. `predicted`: its decision's `expected` hit; `obtained`: blocks it
        hit there (None: not reported); `keys`: its whole computed sequence, now cached there (confirmed);
        `aligned`: keys[i] stands for the replica's block i, so a hit shorter than `predicted` says the
        summary believed blocks the cache no longer had."""
        if not self.uses_prefixes:
            return
        summary = self.summaries[replica]
        if aligned and obtained is not None:
            c = self.counters
            c.predicted_blocks += predicted
            c.obtained_blocks += min(obtained, predicted)
            if obtained < predicted:
                c.shortfalls += 1
                summary.trim(predicted - obtained)
        if keys:
            summary.record(keys, confirmed=True)

    def cache_report(self, replica: int, evicted: Sequence[bytes], overflow: bool) -> None:
        """The replica's cache dropped `evicted` (overflow: more than it logged, or it was reset)."""
        if not self.uses_prefixes:
            return
        if overflow:
            self.summaries[replica].clear()
            self.counters.resets += 1
        self.counters.evictions += self.summaries[replica].forget(evicted)

    def forget_replica(self, replica: int) -> None:
        """The replica restarted or died: whatever its cache held is gone."""
        self.summaries[replica].clear()

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "policy": self.settings.policy,
            "decisions": dict(c.decisions),
            "predicted_hit_blocks": c.predicted_blocks,
            "obtained_hit_blocks": c.obtained_blocks,
            "shortfalls": c.shortfalls,
            "evictions_applied": c.evictions,
            "summary_resets": c.resets,
            "in_flight": list(self.load),
            "summary_blocks": [len(s) for s in self.summaries],
        }
