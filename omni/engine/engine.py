"""StageEngine: one autoregressive stage, in one process. No Ray, no pipeline import here.

The loop that ties the stage's pieces together, as vLLM's EngineCore between its input and output processors:

    add_request()  admission (io/admission.py), then the Request joins the scheduler, the runner and the model
    step()         schedule -> forward -> rows -> scheduler update -> stop strings, logprobs, deltas and
                   outputs (io/outputs.py) -> release what finished -> EngineStepOutput
    abort()        the request is finished and released at once (its id reusable); the next step() reports it

The scheduler is the source of truth of a request's life; `_release_finished` is the one place where all else
the stage holds for a request (runner state, the model's per-request state, collected rows, its text) is
dropped, for the ids the scheduler hands back. max_model_len is resolved once, at start-up (engine_config.cache_size):
at most what the KV cache holds, so that any admitted request can always run to completion, alone if need be.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from omni.errors import StageError
from omni.messages import EdgePayload, StageInput, StageOutput
from omni.stage_info import StageInfo

from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import RequestStatus
from omni.engine.core.scheduler import Scheduler
from omni.engine.engine_config import StageEngineConfig, cache_size
from omni.engine.interface import EngineStepOutput, StageStats
from omni.engine.io.admission import Admission
from omni.engine.io.outputs import OutputProcessor
from omni.engine.io.request_checks import RequestChecker
from omni.engine.io.request_rows import OutputRows, RowsRequest
from omni.engine.io.request_streams import RequestStreams
from omni.engine.io.text_ops import TextOps, renders_own_prompt
from omni.engine.loading import load_stage_model
from omni.engine.memory import check_before_load, check_loaded
from omni.engine.runner.model_runner import ModelRunner, RunnerRequestState
from omni.engine.runner.sampler import make_generator
from omni.engine.stage_model import AutoregressiveStageModel
from omni.engine.stats import StepCounters, stage_stats
from omni.engine.step_profile import StepProfile
from omni.engine.tensor_cache import StageTensorCache

logger = logging.getLogger(__name__)


class StageEngine:
    def __init__(self, config: StageEngineConfig, model: AutoregressiveStageModel | None = None):
        self.config = config
        self.name = config.name
        if model is None:
            check_before_load(config)  # a cache the machine cannot hold fails before minutes of loading
            model = load_stage_model(config.name, config.model_cls, config.model_path, dtype=config.dtype,
                                     device=config.device, model_kwargs=config.model_kwargs,
                                     tokenizer_path=config.tokenizer_path)
        self.model = model
        self.tokenizer = model.tokenizer
        size = cache_size(config, model)
        num_blocks, max_len = size.num_blocks, size.max_model_len
        checks = RequestChecker(self.name, model.vocab_size, self.tokenizer, config.use_chat_template,
                                size.max_len_note)
        check_loaded(config, model, num_blocks)  # before the KV cache, block pool and tensor cache exist
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, config.hash_seed)
        try:
            self.scheduler = Scheduler(config.scheduler, self.kv, max_len)
        except ValueError as e:
            raise ValueError(f"stage {self.name}: scheduler: {e}") from None
        checks.max_model_len = self.scheduler.max_model_len
        self.admission = Admission(self.name, model, checks, config.block_size, self.kv.block_hasher,
                                   config.default_sampling, config.takes_caller_prompt)
        self.text = TextOps(self.name, model, checks)
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, config.attention_backend,
            max_num_tokens=config.scheduler.max_num_batched_tokens, max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=max_len, cuda_graphs=config.cuda_graphs, emit_rows=config.emit_hidden_states)
        # Rows of every computed token (hidden states, discovered outputs) on the KV slot
        # mapping; with prefix caching on this store is the stage tensor cache (hits read
        # rows other requests wrote). Its tensors are allocated on the first write, so a
        # stage that hands no rows out holds none and copies none off the device.
        store = StageTensorCache(num_blocks, config.block_size)
        self.tensor_cache = store if config.enable_prefix_caching else None
        # On a GPU the rows' host-side bookkeeping runs on a background thread (request_rows.py).
        self.rows = OutputRows(store, background=torch.device(model.device).type == "cuda")
        # Rows kept since start-up: every cached block has its rows. A stage that starts
        # keeping them for a request that asks (return_hidden_states) cannot vouch for
        # blocks cached before, so such requests compute their whole prompt.
        self._rows_complete = config.emit_hidden_states
        self._aborted: list[StageOutput] = []  # reported by the next step()
        self.streams = RequestStreams(self.name, self.tokenizer, config.block_size)
        self.counters = StepCounters()
        self.outputs = OutputProcessor(self.name, self.tokenizer, self.scheduler, self.streams, self.counters)
        # Busy time split into forward / sampling / host (step_profile.py); the runner adds to the same counters.
        self.profile = StepProfile()
        self.runner.profile = self.profile

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def info(self) -> StageInfo:
        """The model's facts with the stage's own: the max_model_len in force, whether it renders its prompt."""
        own = renders_own_prompt(self.model)
        return replace(self.model.info, max_model_len=self.max_model_len, renders_own_prompt=own)

    # ------------------------------------------------------------- requests
    def add_request(self, inp: StageInput) -> None:
        """Queue one request; raises RequestError naming the bad field (the stage keeps serving)."""
        t0 = time.perf_counter()
        try:
            self._add_request(inp)
        finally:
            self.profile.busy_s += time.perf_counter() - t0  # admission is host work

    def _add_request(self, inp: StageInput) -> None:
        a = self.admission.admit(inp)
        req, params, rid = a.request, a.params, inp.request_id
        if a.forced is not None:
            # All but the last forced token join the sequence now, so that the prefill computes the prompt
            # and them in one pass (their rows and KV are what generating them would have computed); the
            # last one replaces the one token sampled at the end of that pass (scheduler.update).
            req.forced_token_ids = a.forced
            req.append_output_token_ids(a.forced[:-1])
        self.scheduler.add_request(req)  # raises for an id still running: nothing else is touched
        try:
            stops = self.outputs.watch_stops(rid, params, a.forced is not None)
            # The model sees the request's resolved sampling parameters (a talker that samples inside its
            # forward, e.g. Qwen3-Omni's code predictor, follows the request's temperature and seed).
            self.model.add_request(rid, a.prepared, replace(inp, sampling_params=params))
            self.runner.add_request(RunnerRequestState(req, a.embeds, make_generator(params), a.grammar))
            if inp.stream or not inp.input_complete:
                req.input_complete = inp.input_complete
                self.streams.add(rid, deltas=inp.stream, prompt_rows=a.prompt_rows if not inp.input_complete else None,
                                 text=stops, skip_special_tokens=params.skip_special_tokens,
                                 detokenize=params.detokenize)
            req.compute_limit = self.model.compute_limit(rid)
            if params.prompt_logprobs is not None or params.skip_reading_prefix_cache:
                req.skip_prefix_hits = True  # every prompt position computed (prompt_logprobs: their logits)
            wants_rows = inp.return_hidden_states
            if self.config.emit_hidden_states if wants_rows is None else wants_rows:
                if not self.runner.emits_rows:
                    self.runner.enable_rows()
                if not self._rows_complete:
                    req.skip_prefix_hits = True  # cached blocks may predate the rows
                self.rows.add(rid)
        except BaseException:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            self._release_finished()
            raise

    def tokenize(self, inp: StageInput, add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                 return_token_strs: bool = False) -> dict[str, Any]:
        return self.text.tokenize(inp, add_generation_prompt, add_special_tokens, return_token_strs)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.text.detokenize(token_ids)

    def extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any = None,
                       last: bool = False, payload: EdgePayload | None = None) -> None:
        """Append a chunk to the input of a request admitted with input_complete=False: prompt tokens (and their
        embeddings), and/or model-specific side input (`payload`, for a model that decodes while its input streams
        in). RequestError (naming the field) when the chunk is bad or cannot fit; the prompt stays as it was."""
        t0 = time.perf_counter()
        try:
            self._extend_request(request_id, token_ids, prompt_embeds, last, payload)
        finally:
            self.profile.busy_s += time.perf_counter() - t0  # host work (the model's side input included)

    def _extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any, last: bool,
                        payload: EdgePayload | None) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is None or req.input_complete or request_id not in self.streams:
            # the pipeline's bookkeeping, not the caller's: a chunk for a request this stage does not hold
            raise ValueError(f"request_id: {request_id!r} is not a request of stage {self.name!r} waiting for input")
        state = self.runner.states[request_id]
        token_ids, rows, arr = self.admission.admit_chunk(req, state.prompt_embeds is not None, token_ids,
                                                          prompt_embeds)
        digests = None
        if rows is not None:
            digests = self.streams.extended_digests(request_id, req.prompt_embeds_digests, req.num_prompt_tokens,
                                                    arr)
            state.append_prompt_embeds(rows)
        if token_ids:
            req.extend_prompt(token_ids, digests)
        if payload is not None or last:
            self.model.extend_request(request_id, payload, last)
        if last:
            req.input_complete = True
            if not token_ids and not self.model.info.decodes_before_input_complete:
                self.scheduler.recompute_last_token(req)
        req.compute_limit = self.model.compute_limit(request_id)
        self._take_input()

    def _take_input(self) -> None:
        """A model that takes input after its outputs (StageInfo.takes_input_after_output): the turns it rendered
        since the last call join their requests, and every request's compute limit moves."""
        if self.model.info.takes_input_after_output:
            for rid, token_ids in self.model.take_input().items():
                if rid in self.scheduler.requests and token_ids:
                    self.scheduler.requests[rid].append_input(token_ids)
            for rid, req in self.scheduler.requests.items():
                req.compute_limit = self.model.compute_limit(rid)

    def read_rows(self, request_id: str, start: int, end: int) -> dict[str, np.ndarray]:
        """Per-token rows [start, end) of a running request that keeps rows (end <= its computed tokens)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not running on stage {self.name!r}")
        if not 0 <= start <= end <= req.num_computed_tokens:
            raise ValueError(f"rows [{start}, {end}) of {request_id!r}: only [0, {req.num_computed_tokens}) exist")
        return self.rows.read_range(request_id, self.kv.get_block_ids(request_id), start, end)

    def abort(self, request_id: str) -> None:
        """Finish the request now (unknown ids: nothing happens); the next step() reports it."""
        for req in self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED):
            self._aborted.append(self.outputs.aborted(req))
        self._release_finished()

    def take_evicted_blocks(self) -> tuple[list[bytes], bool]:
        """Prefix-cache block hashes evicted since the previous call (+ whether some went unlogged)."""
        return self.kv.take_evicted()

    def has_unfinished(self) -> bool:
        """Work a step can do now (requests waiting for more input do not count), or aborts to report."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def close(self) -> None:
        """Finish every request (their blocks and per-request state are released)."""
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._release_finished()
        self._aborted.clear()
        self.rows.close()

    # ----------------------------------------------------------------- step
    def step(self) -> EngineStepOutput:
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.profile.busy_s += time.perf_counter() - t0

    def _step(self) -> EngineStepOutput:
        out = EngineStepOutput(aborted=self._aborted)
        self._aborted = []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # a failing batch fails its requests, not the stage
            logger.exception("stage %s: forward pass failed", self.name)
            error = StageError(f"stage {self.name}: forward pass failed: {type(exc).__name__}: {exc}",
                               stage=self.name)
            failed = self.scheduler.finish_requests([s.req_id for s in sched.scheduled], RequestStatus.FINISHED_ERROR)
            out.finished += [self.outputs.failed(req, error) for req in failed]
        else:
            out.forward_rows, out.sampled_rows = result.num_tokens, len(result.sampled)
            if result.rows is not None or result.other_outputs:
                self.rows.collect(result.row_ranges, result.rows, result.other_outputs, result.slot_mapping)
            finished = self.scheduler.update(result.sampled)
            self._take_input()
            if self.outputs.stops:
                finished += self.outputs.stop_strings(result.sampled, finished)
            if result.logprobs:
                self.outputs.record_logprobs(result.logprobs, finished)
            if result.prompt_logprobs:
                self.outputs.record_prompt_logprobs(result.prompt_logprobs, finished)
            rows = {}
            if finished:
                # Block tables as scheduled this step (update() has freed them already).
                tables = {s.req_id: s.block_ids for s in sched.scheduled}
                rows = self.rows.finish([RowsRequest(r.request_id, tables[r.request_id], r.num_computed_tokens,
                                                     max(r.num_cached_tokens, 0)) for r in finished])
            if self.streams.num_active:
                out.deltas = self.streams.step_deltas([s.req_id for s in sched.scheduled], result.sampled,
                                                      self.scheduler.requests, {r.request_id: r for r in finished})
            for req in finished:
                out.finished.append(self.outputs.finished(req, rows.get(req.request_id)))
            self.counters.record_step(time.perf_counter() - t0)
        self._release_finished()
        return out

    def _release_finished(self) -> None:
        """The one release point: drop the runner's, the model's, the rows' and the text's state of every
        request the scheduler finished (ended, aborted or failed) since the last call."""
        for rid in self.scheduler.take_finished_req_ids():
            self.runner.remove_request(rid)
            self.model.remove_request(rid)
            self.rows.drop(rid)
            self.streams.drop(rid)
            self.outputs.drop(rid)

    # ---------------------------------------------------------------- stats
    def stats(self) -> StageStats:  # engine/stats.py
        return stage_stats(self)
