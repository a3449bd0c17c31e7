"""StageEngine: one autoregressive stage, in one process. No Ray, no pipeline import here.

    add_request()  admission (request_checks.py: token ids, prompt + max_tokens within
                   max_model_len, embeddings), then the Request joins the scheduler, the runner
                   and the model
    step()         schedule -> forward -> tensor-cache write + rows -> scheduler update
                   -> release what finished -> EngineStepOutput
    abort()        the scheduler finishes the request and it is released at once, so its
                   id can be reused right away; the next step() reports the abort

The scheduler is the source of truth of a request's life; `_release_finished` is the one
place where everything else the stage holds for a request (runner state, the model's
per-request state, collected rows) is dropped, for the ids the scheduler hands back.

max_model_len is resolved once here: the config's value, else the model's maximum, and
at most what the KV cache holds (lowered with a warning), so that any admitted request
can always run to completion, alone if need be.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.errors import ContextLengthError, RequestError, StageError
from omni.messages import EdgePayload, StageInput, StageOutput, TokenLogprob
from omni.prompts import tokenize_prompt
from omni.sampling_params import SamplingParams, resolve_sampling_params

from omni.engine.io.detokenizer import final_decode
from omni.engine.interface import EngineStepOutput, StageStats
from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.loading import load_stage_model
from omni.engine.memory import check_before_load, check_loaded
from omni.engine.runner.model_runner import ModelRunner, RunnerRequestState
from omni.engine.io.prompt_report import prompt_report
from omni.engine.core.request import Request, RequestStatus
from omni.engine.io.request_checks import RequestChecker
from omni.engine.io.request_rows import FinishedRows, OutputRows, RowsRequest
from omni.engine.io.request_streams import RequestStreams, block_digests
from omni.engine.runner.sampler import make_generator
from omni.engine.core.scheduler import Scheduler, SchedulerSettings
from omni.engine.stage_model import AutoregressiveStageModel
from omni.engine.io.stop_strings import StopText
from omni.engine.step_profile import StepProfile
from omni.engine.io.structured_output import GrammarCompiler
from omni.engine.tensor_cache import StageTensorCache
from omni.engine.io.token_bytes import TokenBytes

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
# Keep the KV cache from defaulting to more blocks than the scheduler could
# ever fill (tiny models would otherwise get millions of blocks).
_DEFAULT_MEMORY_BUDGET_MB = 1024.0


@dataclass(slots=True)
class StageEngineConfig:
    """Resolved configuration of one autoregressive stage.

    omni.pipeline.engine_factory translates the user's omni.config.schema.StageConfig into it;
    tests and benchmarks may build one directly.
    """

    name: str
    model_cls: type[AutoregressiveStageModel]
    model_path: str | Path | None  # a local path (None when a loaded model is handed to the engine)
    tokenizer_path: str | Path | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_mb: float | None = None
    hash_seed: int = 0
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    # None: the model's maximum. Either way at most what the KV cache holds.
    max_model_len: int | None = None
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    use_chat_template: bool = False
    dtype: str = "float32"
    device: str = "auto"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    attention_backend: str | None = None
    # Hand every request's per-token rows (hidden states, discovered outputs) out with its
    # output. A request can say otherwise (StageInput.return_hidden_states); the pipeline
    # always does, from the stage graph (rows only where a downstream stage reads them)
    # and from the caller's return_hidden_states.
    emit_hidden_states: bool = True
    # Capture decode steps in CUDA graphs (CUDA + Triton attention + a model
    # that supports it); False = always eager (vLLM's enforce_eager).
    cuda_graphs: bool = True
    # The stage's prompts are the caller's (a pipeline's entry stage), not made by the pipeline from upstream
    # stages' outputs: SamplingParams.truncate_prompt_tokens cuts only those.
    takes_caller_prompt: bool = True


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
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        max_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        num_blocks = self._num_blocks(config, model, max_len)
        capacity = num_blocks * config.block_size
        # A sequence the cache cannot hold would wait forever (and block the queue behind it).
        self.checks = RequestChecker(self.name, model.vocab_size, self.tokenizer, config.use_chat_template)
        self.grammars = GrammarCompiler(self.name, self.tokenizer, model.vocab_size, model.eos_token_id)
        if max_len > capacity:
            logger.warning("stage %s: the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len "
                           "%d; max_model_len is lowered to %d (raise cache.num_blocks or cache.memory_budget_mb "
                           "to keep it)", self.name, capacity, num_blocks, config.block_size, max_len, capacity)
            self.checks.max_len_note = (f" (lowered from {max_len}: the KV cache holds {num_blocks} blocks of "
                                        f"{config.block_size} tokens)")
            max_len = capacity
        check_loaded(config, model, num_blocks)  # before the KV cache, block pool and tensor cache exist
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, config.hash_seed)
        try:
            self.scheduler = Scheduler(config.scheduler, self.kv, max_len)
        except ValueError as e:
            raise ValueError(f"stage {self.name}: scheduler: {e}") from None
        self.checks.max_model_len = self.scheduler.max_model_len
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
        self._stops: dict[str, StopText] = {}  # requests with stop strings: their text, watched (stop_strings.py)
        self._ttfts: list[float] = []
        self._num_finished = 0
        self._num_errors = 0
        self._step_time = 0.0
        self._num_steps = 0
        # Busy time (steps, admissions) split into forward / sampling / host (step_profile.py); the
        # runner adds its forward and sampler intervals to the same counters.
        self.profile = StepProfile()
        self.runner.profile = self.profile

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @staticmethod
    def _num_blocks(config: StageEngineConfig, model: AutoregressiveStageModel, max_len: int) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        per_block = ModelRunner.kv_bytes_per_block(model, config.block_size)
        budget = config.memory_budget_mb or _DEFAULT_MEMORY_BUDGET_MB
        by_budget = int(budget * 2**20 // per_block)
        if config.memory_budget_mb is None:
            needed = -(-config.scheduler.max_num_seqs * max_len // config.block_size) + 1
            by_budget = min(by_budget, needed)
        if by_budget < 2:
            raise ValueError(
                f"stage {config.name}: cache.memory_budget_mb={budget} holds {by_budget} blocks of "
                f"{per_block} bytes; at least 2 are needed")
        return by_budget

    # ------------------------------------------------------------- requests
    def add_request(self, inp: StageInput) -> None:
        """Queue one request; raises RequestError naming the bad field (the stage keeps serving)."""
        t0 = time.perf_counter()
        try:
            self._add_request(inp)
        finally:
            self.profile.busy_s += time.perf_counter() - t0  # admission is host work

    def _add_request(self, inp: StageInput) -> None:
        rid = inp.request_id
        params = resolve_sampling_params(inp.sampling_params, self.config.default_sampling)
        self.checks.sampling(params)
        self.checks.given_not_empty(inp)  # before any stage model's preprocess: none need handle 0 tokens
        prepared = self.model.preprocess(inp)
        if prepared is None and inp.mm_inputs:  # the stage model would silently drop them
            kinds = sorted({m.modality for m in inp.mm_inputs})
            raise RequestError(f"multi_modal_data: stage {self.name!r} takes no {'/'.join(kinds)} inputs "
                               "(a text-only model)", stage=self.name, field="multi_modal_data")
        if prepared is not None and inp.tools and not getattr(self.model, "renders_tools", False):
            # its own prompt renderer, which shows the model no tools: they would be silently dropped
            raise RequestError(f"tools: stage {self.name!r} renders its own prompt and shows the model no tools",
                               stage=self.name, field="tools")
        token_ids = (self.checks.token_ids(prepared.token_ids, "prompt_token_ids") if prepared is not None
                     else self.checks.prompt_ids(inp))
        prompt_embeds = prepared.prompt_embeds if prepared is not None else inp.prompt_embeds
        self.checks.not_empty(token_ids)
        if params.truncate_prompt_tokens is not None and self.config.takes_caller_prompt:
            token_ids = self._truncated(token_ids, params.truncate_prompt_tokens,
                                        prepared is not None or prompt_embeds is not None or not inp.input_complete)
        n = len(token_ids)
        if params.max_tokens_fit:
            room = self.max_model_len - n - params.reserve_tokens  # what the prompt leaves the reply
            if room < 1:
                raise ContextLengthError(
                    f"prompt: {n} tokens leave no room for a reply in max_model_len {self.max_model_len} of stage "
                    f"{self.name!r}{self.checks.max_len_note} (with {params.reserve_tokens} tokens kept free for the "
                    "stages after it); shorten the prompt", stage=self.name, field="prompt",
                    limit=self.max_model_len - params.reserve_tokens, actual=n)
            if params.max_tokens > room:
                params = params.model_copy(update={"max_tokens": room, "min_tokens": min(params.min_tokens, room)})
        forced = self._forced_reply(params)
        if forced is not None and not inp.input_complete:
            raise RequestError("sampling_params.forced_token_ids: a forced reply follows a complete prompt; this "
                               "request's input still streams in", stage=self.name,
                               field="sampling_params.forced_token_ids")
        if forced is None:
            self.checks.fits(n, params.max_tokens)
        else:
            self.checks.fits(n, len(forced), "sampling_params.forced_token_ids" if params.forced_token_ids is not None
                             else "sampling_params.forced_text")
        if params.prompt_logprobs is not None and (forced is not None or not inp.input_complete):
            raise RequestError("sampling_params.prompt_logprobs: needs a complete prompt and a sampled reply (not a "
                               "streamed input, nor a forced reply)", stage=self.name,
                               field="sampling_params.prompt_logprobs")
        grammar = None if params.structured_outputs is None else self.grammars.matcher(params.structured_outputs)
        embeds, digests, rows = None, None, None
        if prompt_embeds is not None:
            embeds, digests, rows = self._prompt_embeds(prompt_embeds, n)
        req = Request(
            rid, token_ids, sampling_params=params, cache_salt=inp.cache_salt,
            mm_features=prepared.mm_features if prepared is not None else (),
            prompt_embeds_digests=digests, block_hasher=self.kv.block_hasher,
            arrival_time=time.monotonic(), eos_token_id=self.model.eos_token_id,
        )
        if forced is not None:
            # All but the last forced token join the sequence now, so that the prefill computes the prompt
            # and them in one pass (their rows and KV are what generating them would have computed); the
            # last one replaces the one token sampled at the end of that pass (scheduler.update).
            req.forced_token_ids = forced
            req.append_output_token_ids(forced[:-1])
        self.scheduler.add_request(req)  # raises for an id still running: nothing else is touched
        try:
            # (a forced reply is exactly its tokens: nothing cuts it; a stage without a tokenizer, e.g. a talker given
            # the one SamplingParams a caller set for every stage, makes no text a stop string could end)
            if params.stop and forced is None and self.tokenizer is not None:
                self._stops[rid] = StopText(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                            params.skip_special_tokens)
            # The model sees the request's resolved sampling parameters (a talker that samples inside its
            # forward, e.g. Qwen3-Omni's code predictor, follows the request's temperature and seed).
            self.model.add_request(rid, prepared, replace(inp, sampling_params=params))
            self.runner.add_request(RunnerRequestState(req, embeds, make_generator(params), grammar))
            if inp.stream or not inp.input_complete:
                req.input_complete = inp.input_complete
                self.streams.add(rid, deltas=inp.stream, prompt_rows=rows if not inp.input_complete else None,
                                 text=self._stops.get(rid), skip_special_tokens=params.skip_special_tokens)
            req.compute_limit = self.model.compute_limit(rid)
            if params.prompt_logprobs is not None:
                req.skip_prefix_hits = True  # every prompt position's logits: none may come from the cache
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

    @property
    def _renders_own_prompt(self) -> bool:
        """The stage model turns a request's text or chat messages into its prompt itself (its own preprocess)."""
        return type(self.model).preprocess is not AutoregressiveStageModel.preprocess

    def tokenize(self, inp: StageInput, add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                 return_token_strs: bool = False) -> dict[str, Any]:
        """vLLM's /tokenize: {"tokens", "token_strs", "max_model_len"}, the prompt's ids as admission computes them
        (a model that renders its own prompt, the omni thinkers, renders it here too). At the defaults exactly a
        request's prompt; add_generation_prompt false / add_special_tokens (vLLM's other cases) only where the
        stage's chat template renders it. Changes nothing of the stage's state."""
        if self.tokenizer is None:
            raise RequestError(f"prompt: stage {self.name!r} has no tokenizer to tokenize with", stage=self.name,
                               field="prompt")
        if inp.mm_inputs:
            raise RequestError("multi_modal_data: tokenize takes text (the media's placeholders are the model's)",
                               stage=self.name, field="multi_modal_data")
        self.checks.given_not_empty(inp)
        own = self._renders_own_prompt
        if own and (not add_generation_prompt or add_special_tokens is not None):
            field = "add_generation_prompt" if not add_generation_prompt else "add_special_tokens"
            raise RequestError(f"{field}: stage {self.name!r} renders its own prompt, always with the generation "
                               "prompt and its own special tokens", stage=self.name, field=field)
        if own:
            prepared = self.model.preprocess(inp)
            ids = list(prepared.token_ids) if prepared is not None else self.checks.prompt_ids(inp)
        elif inp.prompt is not None and (not add_generation_prompt or add_special_tokens is not None):
            ids = tokenize_prompt(self.tokenizer, inp.prompt, self.checks.use_chat_template
                                  and inp.chat_template is not False, self.name, inp.tools, inp.chat_template_kwargs,
                                  add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens)
        else:
            ids = self.checks.prompt_ids(inp)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if return_token_strs else None
        return {"tokens": [int(t) for t in ids], "token_strs": strs, "max_model_len": self.max_model_len}

    def detokenize(self, token_ids: list[int]) -> str:
        """vLLM's /detokenize: the text of the ids, special tokens shown (ids checked against the vocabulary)."""
        if self.tokenizer is None:
            raise RequestError(f"tokens: stage {self.name!r} has no tokenizer to decode with", stage=self.name,
                               field="tokens")
        ids = self.checks.token_ids(list(token_ids), "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _truncated(self, token_ids: list[int], keep: int, fixed: bool) -> list[int]:
        """The last `keep` tokens of the prompt (-1: max_model_len), vLLM's truncate_prompt_tokens. `fixed`: the
        prompt is not plain tokens (the model rendered it with positions or features of its own, it came as
        embeddings, or it is still streaming in): it is refused if it would have to be cut."""
        field = "sampling_params.truncate_prompt_tokens"
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise RequestError(f"{field}: {keep} is greater than max_model_len {self.max_model_len} of stage "
                               f"{self.name!r}; choose a smaller truncation size", stage=self.name, field=field,
                               limit=self.max_model_len, actual=keep)
        if len(token_ids) <= keep:
            return token_ids
        if fixed:
            raise RequestError(f"{field}: the prompt of stage {self.name!r} has {len(token_ids)} tokens, more than "
                               f"{keep}, and cannot be cut (the stage renders its own prompt, or it came as "
                               "embeddings or as a streamed input); shorten the prompt", stage=self.name, field=field,
                               limit=keep, actual=len(token_ids))
        return token_ids[-keep:]

    def _forced_reply(self, params: SamplingParams) -> list[int] | None:
        """The token ids a request's reply is forced to (sampling_params.forced_token_ids / forced_text)."""
        if params.forced_token_ids is not None:
            return self.checks.token_ids(params.forced_token_ids, "sampling_params.forced_token_ids")
        if params.forced_text is None:
            return None
        if self.tokenizer is None:
            raise RequestError(f"sampling_params.forced_text: stage {self.name!r} has no tokenizer; send "
                               "forced_token_ids instead", stage=self.name, field="sampling_params.forced_text")
        ids = list(self.tokenizer.encode(params.forced_text, add_special_tokens=False))
        if self.model.eos_token_id is not None:
            ids.append(int(self.model.eos_token_id))
        if not ids:
            raise RequestError("sampling_params.forced_text: the text has no tokens", stage=self.name,
                               field="sampling_params.forced_text")
        return self.checks.token_ids(ids, "sampling_params.forced_text")

    def _prompt_embeds(self, value: Any, num_tokens: int) -> tuple[torch.Tensor, list[bytes], np.ndarray]:
        arr = self.checks.prompt_embeds(value, num_tokens, self.model.prompt_embed_size or self.model.hidden_size)
        # One digest per block of rows: the block hashes chain them, so equal
        # leading embeddings still share blocks across turns.
        digests = block_digests(arr, self.config.block_size)
        t = torch.from_numpy(arr).to(device=self.model.device, dtype=self.model.dtype)
        return t, digests, arr

    def extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any = None,
                       last: bool = False, payload: EdgePayload | None = None) -> None:
        """Append a chunk to the input of a request admitted with input_complete=False: prompt tokens
        (and their embeddings), and/or model-specific side input (`payload`, for a model that decodes
        while its input streams in). ValueError (naming the field) when the chunk is bad or cannot
        fit; the prompt stays as it was."""
        t0 = time.perf_counter()
        try:
            self._extend_request(request_id, token_ids, prompt_embeds, last, payload)
        finally:
            self.profile.busy_s += time.perf_counter() - t0  # host work (the model's side input included)

    def _extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any, last: bool,
                        payload: EdgePayload | None) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is None or req.input_complete or request_id not in self.streams:
            raise ValueError(f"request_id: {request_id!r} is not a request of stage {self.name!r} waiting for input")
        token_ids = self.checks.token_ids(token_ids, "prompt_token_ids")
        self.checks.fits(req.num_prompt_tokens + len(token_ids), req.sampling_params.max_tokens)
        state = self.runner.states[request_id]
        if (prompt_embeds is None) != (state.prompt_embeds is None) and token_ids:
            raise ValueError("prompt_embeds: a prompt that started as embeddings grows by embeddings, and a "
                             "prompt of token ids by token ids")
        digests = None
        if prompt_embeds is not None and token_ids:
            rows, digests, arr = self._prompt_embeds(prompt_embeds, len(token_ids))
            digests = self.streams.extended_digests(request_id, req.prompt_embeds_digests, req.num_prompt_tokens,
                                                    arr)
            state.append_prompt_embeds(rows)
        if token_ids:
            req.extend_prompt(token_ids, digests)
        if payload is not None or last:
            self.model.extend_request(request_id, payload, last)
        if last:
            req.input_complete = True
            if not token_ids and not self.model.decodes_before_input_complete:
                self.scheduler.recompute_last_token(req)
        req.compute_limit = self.model.compute_limit(request_id)

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
            # what the stage knew of the prompt when it stopped (its cache hit and split by kind), as a finished
            # output reports it: the prompt was read whether or not the reply was done
            mm, cached_mm = req.mm_token_counts()
            self._aborted.append(StageOutput(
                request_id, self.name, prompt_token_ids=list(req.prompt_token_ids),
                token_ids=list(req.output_token_ids), finished=True, finish_reason="abort",
                num_cached_tokens=max(req.num_cached_tokens, 0), prompt_mm_tokens=mm, cached_mm_tokens=cached_mm))
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
            for req in failed:
                self._num_errors += 1
                out.finished.append(StageOutput(req.request_id, self.name, prompt_token_ids=list(req.prompt_token_ids),
                                                finished=True, finish_reason="error", error=error))
        else:
            if result.rows is not None or result.other_outputs:
                self.rows.collect(result.row_ranges, result.rows, result.other_outputs, result.slot_mapping)
            finished = self.scheduler.update(result.sampled)
            if self._stops:
                finished += self._stop_strings(result.sampled, finished)
            if result.logprobs:
                self._record_logprobs(result.logprobs, finished)
            for rid, (first, entries) in result.prompt_logprobs.items():
                req = self.scheduler.requests.get(rid) or next((r for r in finished if r.request_id == rid), None)
                have = len(req.prompt_logprobs) if req is not None else first
                if req is not None and first <= have < first + len(entries):  # a recomputed prefill adds nothing twice
                    req.prompt_logprobs.extend(entries[have - first :])
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
                out.finished.append(self._make_output(req, rows.get(req.request_id)))
            self._step_time += time.perf_counter() - t0
            self._num_steps += 1
        self._release_finished()
        return out

    def _stop_strings(self, sampled: dict[str, int], finished: list[Request]) -> list[Request]:
        """Feed this step's tokens to the requests with stop strings; those whose text now holds one end here
        (returned: finished in this step like the ones update() ended). One that update() ended anyway (eos,
        max_tokens) has its text settled and searched once more."""
        done = {r.request_id: r for r in finished}
        ended = []
        for rid in sampled:
            st = self._stops.get(rid)
            if st is None:
                continue
            if rid in done:
                req = done[rid]
                st.feed(req.text_token_ids(), req.num_output_tokens >= req.sampling_params.min_tokens)
                st.finish()
                continue
            req = self.scheduler.requests.get(rid)
            # vLLM's min_tokens holds stop strings back too: none is looked for before it (one that ended earlier
            # never stops the reply)
            check = req is not None and req.num_output_tokens >= req.sampling_params.min_tokens
            if req is not None and st.feed(req.output_token_ids, check) is not None:
                stopped = self.scheduler.stop(rid)
                if stopped is not None:
                    ended.append(stopped)
        return ended

    def _record_logprobs(self, logprobs: dict[str, tuple[float, list[tuple[int, float]]]],
                         finished: list[Request]) -> None:
        """The sampled tokens' log-probabilities, on the requests that took their token this step (not an
        aborted one, nor a forced reply, whose tokens were not sampled), with the tokens' texts."""
        done = {r.request_id: r for r in finished}
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        raw = self.token_bytes or (lambda t: None)
        for rid, (lp, top) in logprobs.items():
            req = self.scheduler.requests.get(rid) or done.get(rid)
            if req is None or req.forced_token_ids is not None or len(req.output_logprobs) >= req.num_output_tokens:
                continue
            token = req.output_token_ids[len(req.output_logprobs)]
            req.output_logprobs.append(TokenLogprob(token, lp, text(token), [(t, p, text(t), raw(t)) for t, p in top],
                                                    token_bytes=raw(token)))

    def _release_finished(self) -> None:
        """The one release point: drop the runner's, the model's and the rows' state of every request
        the scheduler finished (ended, aborted or failed) since the last call."""
        for rid in self.scheduler.take_finished_req_ids():
            self.runner.remove_request(rid)
            self.model.remove_request(rid)
            self.rows.drop(rid)
            self.streams.drop(rid)
            self._stops.pop(rid, None)

    def _make_output(self, req: Request, rows: FinishedRows | None = None) -> StageOutput:
        rid = req.request_id
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        self._num_finished += 1
        if ttft is not None:
            self._ttfts.append(ttft)
            del self._ttfts[:-1000]
        out = StageOutput(
            rid, self.name,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            finished=True,
            finish_reason=_FINISH_REASONS.get(req.status, "stop"),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics={"ttft_s": ttft or 0.0, "e2e_s": time.monotonic() - req.arrival_time},
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
        )
        report = prompt_report(req, self.tokenizer)
        out.prompt_text, out.prompt_token_texts, out.prompt_logprobs = report.text, report.token_texts, report.logprobs
        out.prompt_mm_tokens, out.cached_mm_tokens = req.mm_token_counts()
        if self.tokenizer is not None:
            out.text = final_decode(self.tokenizer, req.text_token_ids(), req.sampling_params.skip_special_tokens)
            streamed = self.streams.final_text(rid)
            if streamed is not None and streamed != out.text and rid not in self._stops:
                # A decoder whose output is not prefix-stable: the caller saw the deltas, keep them true.
                logger.warning("stage %s: streamed text of %s differs from its full decode", self.name, rid)
                out.text = streamed
        params = req.sampling_params
        stop = self._stops.get(rid)
        if stop is not None:  # its text ends at its stop string (stop_strings.py)
            stop.finish()
            out.text = stop.final_text()
            if stop.stopped is not None:
                out.finish_reason, out.stop_reason = "stop", stop.stopped
        if (out.stop_reason is None and req.ended_by_stop_token and req.output_token_ids[-1] in params.stop_token_ids
                and (params.ignore_eos or req.output_token_ids[-1] != req.eos_token_id)):
            out.stop_reason = req.output_token_ids[-1]  # vLLM's: the stop token id (eos is none)
        if rows is not None:
            out.hidden_states, out.mm_outputs, out.passthrough = rows.hidden_states, rows.mm_outputs, rows.passthrough
        return out

    # ---------------------------------------------------------------- stats
    def stats(self) -> StageStats:
        kv = self.kv.stats()
        ttfts = sorted(self._ttfts)
        extra = dict(self.tensor_cache.stats()) if self.tensor_cache is not None else {}
        extra.update(self.runner.stats())
        extra.update(device=str(self.model.device), tensor_cache_worker_time_s=self.rows.worker_time_s,
                     tensor_cache_write_time_s=self.rows.write_time_s, rows_deliver_time_s=self.rows.deliver_time_s,
                     rows_delivered=self.rows.rows_delivered)
        if self._renders_own_prompt:
            # it renders its own prompts: whether a request's tools reach the model (else they are refused)
            extra["shows_tools"] = bool(self.model.renders_tools)
        extra.update(self.model.stats())
        return StageStats(
            stage=self.name,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage,
            num_blocks=self.kv.num_blocks,
            max_model_len=self.max_model_len,
            prefix_caching=self.config.enable_prefix_caching,
            prefix_cache_queries=kv["queries"],
            prefix_cache_hits=kv["hits"],
            prefix_cache_hit_rate=kv["hit_rate"],
            preemptions=self.scheduler.num_preemptions,
            finished=self._num_finished,
            errors=self._num_errors,
            ttft_mean_s=(sum(ttfts) / len(ttfts)) if ttfts else None,
            ttft_p50_s=ttfts[len(ttfts) // 2] if ttfts else None,
            steps=self._num_steps,
            step_time_s=self._step_time,
            tensor_cache_time_s=self.rows.time_s,
            torch_threads=torch.get_num_threads(),
            **self.profile.stats(),
            extra=extra,
        )
