"""The engine contract: what the pipeline calls on one stage's engine, and what comes back.

    add_request(inp)    queue a request; a RequestError (omni.errors) naming the field when
                        it is bad (the engine keeps serving)
    extend_request(request_id, token_ids, prompt_embeds, last)
                        grow the prompt of a request admitted with input_complete=False
                        (a streaming edge); a RequestError when the chunk is bad
    read_rows(request_id, start, end)
                        per-token rows [start, end) of a live request (streamed downstream)
    abort(request_id)   release the request at once (its id may be reused right away);
                        the next step() reports it in `aborted`
    step()              one scheduling step -> EngineStepOutput
    has_unfinished()    anything queued, running, or an abort not yet reported
    stats()             StageStats (counters only)
    info()              StageInfo: the stage model's facts and the stage's max_model_len; the
                        pipeline asks once, when the stage starts (StageWorker.info)
    close()             release what the engine holds
    take_evicted_blocks()  optional: prefix-cache block hashes evicted since the previous call,
                        and whether some went unlogged (a router corrects its picture of the
                        stage's cache with them; an engine without a prefix cache leaves it out)

Both StageEngine (autoregressive) and OneShotStageEngine (one-shot) implement it; so
can a test double. Only a RequestError is the caller's fault: anything else an engine raises
(a bare ValueError included) fails the request as the stage's (a StageError, a 500).

One request, one terminal output: a request that finishes (stop, length or error) appears
once in `finished`, the step that releases it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from omni.messages import EdgePayload, StageDelta, StageInput, StageOutput
from omni.stage_info import StageInfo


@dataclass(slots=True)
class EngineStepOutput:
    """What one step() produced."""

    # One terminal output per request that finished in this step; their ids are the
    # step's finished_req_ids: the engine has released them, the caller releases its own state.
    finished: list[StageOutput] = field(default_factory=list)
    # One report per request aborted since the previous step (already released by abort()).
    aborted: list[StageOutput] = field(default_factory=list)
    # Progress of streamed requests (StageInput.stream) in this step, in step order;
    # a request finishing in this step has its last delta here and its output in `finished`.
    deltas: list[StageDelta] = field(default_factory=list)
    # The work of this step's forward pass: rows computed and rows sampled (0, 0 when there was none,
    # or for an engine that does not count them). Benchmarks time their GEMM references at these sizes.
    forward_rows: int = 0
    sampled_rows: int = 0

    @property
    def finished_req_ids(self) -> list[str]:
        return [o.request_id for o in self.finished]


@dataclass(slots=True)
class StageStats:
    """One stage's counters (typed here, a flat dict for users: `as_dict()`)."""

    stage: str
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    max_model_len: int | None = None
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    preemptions: int = 0
    finished: int = 0
    errors: int = 0
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    steps: int = 0
    step_time_s: float = 0.0
    tensor_cache_time_s: float = 0.0
    torch_threads: int | None = None
    # Where the stage's time went (step_profile.py): busy = forward + sampling + host, since uptime_s
    # ago; None where the engine does not split its steps (its step_time_s is then all forward).
    busy_time_s: float | None = None
    forward_time_s: float | None = None
    sampling_time_s: float | None = None
    host_time_s: float | None = None
    uptime_s: float | None = None
    # Counters only some stages have (tensor cache, encoder cache, ...), merged flat into as_dict().
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        return {**d, **extra}


class Engine(Protocol):
    name: str

    def add_request(self, inp: StageInput) -> None: ...
    def extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any = None,
                       last: bool = False, payload: EdgePayload | None = None) -> None: ...
    def read_rows(self, request_id: str, start: int, end: int) -> dict[str, Any]: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> EngineStepOutput: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> StageStats: ...
    def info(self) -> StageInfo: ...
    # vLLM's /tokenize and /detokenize on this stage: a prompt's token ids as the stage computes them (its own prompt
    # renderer included) and the text of token ids; a stage with no text (one-shot) raises RequestError
    def tokenize(self, inp: StageInput, add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                 return_token_strs: bool = False) -> dict[str, Any]: ...
    def detokenize(self, token_ids: list[int]) -> str: ...
    def close(self) -> None: ...
