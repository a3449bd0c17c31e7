"""Continuous-batching scheduler in the vLLM v1 style. No torch here.

There are no prefill/decode phases: each step hands out a token budget so that
every request's `num_computed_tokens` catches up with its `num_tokens`
(prompt + generated). Running requests go first, then waiting ones in FCFS
order; a prompt larger than the remaining budget is chunked. A waiting (or
preempted) request starts from its prefix-cache hit. When the KV cache runs
out, the most recently started running request is preempted: its blocks are
freed and it is recomputed later (its cached prefix usually survives).

The scheduler is the source of truth of a request's life in the stage: it
leaves through `finish_requests` (aborted, failed) or `update` (stopped,
length), and its id is recorded in `finished_req_ids` until the engine takes
them (`take_finished_req_ids`) and releases the request's state everywhere else.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from omni.errors import RequestError
from omni.sampling_params import check_prefill_fits

from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerSettings:
    """Batching limits of one stage (resolved from omni.config.schema.SchedulerConfig; same defaults)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class ScheduledRequest:
    req_id: str
    num_computed_tokens: int  # before this step (includes the prefix-cache hit)
    num_scheduled_tokens: int
    block_ids: list[int]  # the request's whole block table (the manager's list)
    # First step since the request was added or resumed: the runner (re)builds
    # its state and gathers the cached rows of its prefix hit.
    is_new: bool
    num_hit_tokens: int = 0  # prefix-cache hit served from cache (is_new only)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, settings: SchedulerSettings, kv_manager: KVCacheManager, max_model_len: int):
        check_prefill_fits(settings.max_num_batched_tokens, max_model_len, settings.enable_chunked_prefill)
        self.settings = settings
        self.max_model_len = max_model_len
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests that left since the engine last took them: it releases their state.
        self.finished_req_ids: list[str] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestError(f"request_id {request.request_id!r} is already in use on this stage",
                               field="request_id", code="duplicate_request_id", request_id=request.request_id)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside a step (aborted, or failed in the forward pass); unknown ids are
        skipped. A failed request's blocks were cached at scheduling time but their KV may never have
        been written: the blocks only it holds are uncached."""
        finished = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status, uncache=status == RequestStatus.FINISHED_ERROR)
                finished.append(req)
        return finished

    def take_finished_req_ids(self) -> list[str]:
        ids, self.finished_req_ids = self.finished_req_ids, []
        return ids

    def has_unfinished(self) -> bool:
        """Work to schedule: requests waiting for more input (a streaming edge) do not count."""
        return bool(self.waiting) or any(r.num_computed_tokens < r.computable_tokens for r in self.running)

    def recompute_last_token(self, req: Request) -> None:
        """A growing prompt was completed with nothing new: its last token was computed without
        sampling. Compute it again (same slot, same K/V) so that the step samples from its logits."""
        if req.status == RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.settings.max_num_batched_tokens

        # 1. Running requests, oldest first. A request that cannot get blocks
        #    preempts the newest running request (possibly itself).
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.computable_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                idx += 1
                continue
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing smaller can be running behind it
            out.scheduled.append(ScheduledRequest(
                req.request_id, req.num_computed_tokens, num_new,
                self.kv.get_block_ids(req.request_id), is_new=False))
            budget -= num_new
            idx += 1

        # 2. Waiting requests, FCFS; stop at the first that does not fit.
        if not out.preempted_req_ids:
            while self.waiting and budget > 0 and len(self.running) < self.settings.max_num_seqs:
                req = self.waiting[0]
                hit_blocks, num_hit = ([], 0) if req.skip_prefix_hits else self.kv.get_computed_blocks(req)
                num_new = req.computable_tokens - num_hit
                if num_new <= 0:
                    break  # its streamed input is behind even the cached part: nothing to run yet
                if num_new > budget:
                    if not self.settings.enable_chunked_prefill:
                        break
                    num_new = budget
                if self.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(
                    req.request_id, num_hit, num_new,
                    self.kv.get_block_ids(req.request_id), is_new=True, num_hit_tokens=num_hit))
                budget -= num_new

        out.num_batched_tokens = self.settings.max_num_batched_tokens - budget
        # Advance the counters now: the runner computes exactly these tokens.
        for s in out.scheduled:
            self.requests[s.req_id].num_computed_tokens += s.num_scheduled_tokens
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ----------------------------------------------------------------- update
    def update(self, sampled: dict[str, int]) -> list[Request]:
        """Append sampled tokens, apply stop conditions; returns finished requests."""
        finished: list[Request] = []
        now = time.monotonic()
        for req_id, token in sampled.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while its step was running
            if req.forced_token_ids is not None:  # a forced reply: its next token, whatever was sampled
                token = req.forced_token_ids[req.num_output_tokens]
            req.append_output_token_ids(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.forced_token_ids is not None:  # neither eos, stop tokens nor max_tokens cut a forced reply
            return RequestStatus.FINISHED_STOPPED if req.num_output_tokens >= len(req.forced_token_ids) else None
        if (not params.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id
                or token in params.stop_token_ids):
            req.ended_by_stop_token = True
            return RequestStatus.FINISHED_STOPPED
        if req.structured_done:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stop(self, req_id: str) -> Request | None:
        """End a running request as stopped (its reply's text reached a stop string: the engine's check, which needs
        the text the scheduler does not have); None when it is not running."""
        req = self.requests.get(req_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return None
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return req

    def _finish(self, req: Request, status: RequestStatus, uncache: bool = False) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req, uncache=uncache)
        req.status = status
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)
