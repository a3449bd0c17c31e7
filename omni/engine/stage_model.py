"""The interface between the engines and model-specific stage models (in `stages/`).

The runtime knows nothing model-specific. A stage model is one of two kinds, each
run by its own engine (the pipeline's engine factory picks it from the registry):

    AutoregressiveStageModel   StageEngine: KV cache, scheduler, prefix caching;
                               embed / packed forward / logits, per-request hooks
    OneShotStageModel          OneShotStageEngine: one call per request
                               (e.g. token2wav: codec tokens -> waveform)

Whatever per-token tensors `forward` returns besides `hidden_states` are
discovered by the runner and cached/concatenated like hidden states (see
tensor_cache.py). Every hook the engines, the pipeline and the planner call is declared
here, with a default where a model may leave it out; a model's facts are one StageInfo
(omni/stage_info.py), its class attribute `info`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omni.stage_info import StageInfo
from omni.errors import RequestError

if TYPE_CHECKING:
    from omni.engine.memory import StageGeometry
    from omni.engine.core.request import MultiModalFeature
    from omni.messages import EdgePayload, StageInput


@dataclass(slots=True)
class KVSpec:
    """What the runner needs to allocate the paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class PreparedPrompt:
    """A model-specific stage's view of one request's prompt (see AutoregressiveStageModel.preprocess)."""

    token_ids: list[int]
    # Multimodal inputs placed in the prompt (content hash + placeholder span):
    # they become extra keys of the block hashes.
    mm_features: list["MultiModalFeature"] = field(default_factory=list)
    # [num_tokens, hidden] rows replacing the token embeddings (None: embed token ids).
    prompt_embeds: np.ndarray | None = None
    # Anything the stage model keeps per request (pixel values, mrope positions, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # The reply the model forces for this request, as sampling_params.forced_token_ids would (a stage with nothing to
    # do for it: a voice agent's ears on a typed turn reply [eos] at once); None: sampled.
    forced_reply: list[int] | None = None


class StageModel:
    """What every stage model has: loading, its device/dtype/tokenizer, its facts, the planner's hooks, stats."""

    # Its facts, declared once: a registered model's class and its registration name the same object, from a
    # torch-free module of its family (omni/registry.py says why). A loaded model may replace it with a copy
    # that fills in what its checkpoint knows (`voices`); the engine reads it, the pipeline reads it once at
    # start through the engine's info().
    info: StageInfo

    tokenizer: Any = None
    device: torch.device
    dtype: torch.dtype
    # Names of its tensors in the checkpoint start with this (a checkpoint holding several stages,
    # e.g. "thinker."): the memory planner sums their sizes from the safetensors headers.
    checkpoint_prefix: str = ""

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None,
             tokenizer_path: Path | None = None) -> "StageModel":
        """The model with its weights on `device`. Called once by its engine (omni/engine/loading.py)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> "StageGeometry | None":
        """Cache geometry (layers, KV heads, head dim, hidden size) read from the checkpoint's config
        without loading weights. Called by StageEngine before it loads the model (omni/engine/memory.py:
        it refuses caches the machine cannot hold) and by `omni plan` (omni/planning/needs.py: an
        autoregressive stage's KV and row sizes). None: known only once loaded."""
        return None

    @classmethod
    def encoder_cache_bytes(cls, model_kwargs: dict[str, Any], geometry: "StageGeometry", dtype_bytes: int,
                            item_rows: int) -> int:
        """The bytes its own encoder cache holds at its fullest (`model_kwargs` as `load` reads them; each
        media item at most `item_rows` rows). Called by `omni plan` (omni/planning/needs.py) for an
        autoregressive stage; 0: it keeps none."""
        return 0

    def profile_inputs(self, lengths: list[int]) -> "list[StageInput] | None":
        """Requests whose prompts have `lengths` tokens, shaped as the stage's input processor builds them.
        Called by `omni plan`'s profile step (omni/planning/profile.py) on the loaded model; None: the
        planner's default (token-id prompts of those lengths)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Model-specific counters merged into the stage's stats by its engine's stats() (e.g. encoder cache
        hits). Counters only: the model's facts are its `info`."""
        return {}


class AutoregressiveStageModel(StageModel):
    """A model run token by token by StageEngine. Subclasses implement every method up to the hooks."""

    info = StageInfo()
    # True when `forward` reads nothing but its tensor arguments and the
    # ForwardContext's device tensors (no per-request host state), so that a
    # decode step can be captured once in a CUDA graph and replayed. A model
    # that keeps per-request host state may still opt in: it sees a capture as
    # a ForwardContext without req_ids, and `before_graph_replay` (below) hands
    # it the replayed rows' requests to set its own device buffers from.
    supports_cuda_graphs: bool = False
    # True: a graph replays only steps whose every token is a generated one (not
    # a one-token prompt chunk, which may need, say, an encoder's rows).
    graphs_need_generated_tokens: bool = False

    hidden_size: int  # width of the last hidden states it emits
    # Width of rows accepted as `prompt_embeds` when it differs from
    # hidden_size (a talker fed a wider thinker's embeddings); None = hidden_size.
    prompt_embed_size: int | None = None
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None

    def kv_spec(self) -> KVSpec:
        """The paged KV cache's shape; read by the model runner (and the loaded-model memory check) when
        StageEngine builds it."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings. Called by the model runner in a step that mixes
        prompt embeddings with token ids."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """One packed varlen forward pass over T tokens (exactly one of
        input_ids [T] / inputs_embeds [T, hidden]). Returns at least
        "hidden_states": [T, hidden] (the last hidden states). Called by the model runner once a step
        (or captured in a CUDA graph)."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits. Called by the model runner for the rows it samples (and
        the rows of prompt logprobs)."""
        raise NotImplementedError

    def prepare_cuda_graphs(self, max_num_seqs: int) -> None:
        """Called by the model runner before capture (a model with supports_cuda_graphs): allocate the
        persistent device buffers a captured forward reads (their addresses are baked into the graphs)."""

    def before_graph_replay(self, req_ids: list[str], padded: int) -> None:
        """Called by the model runner before a graph replays a decode step of `req_ids` (rows in order; `padded`
        rows in all): fill the buffers of `prepare_cuda_graphs` for these rows."""

    # -- optional hooks (multimodal / model-specific stages) -----------------
    def preprocess(self, inp: "StageInput") -> PreparedPrompt | None:
        """Turn a request into token ids etc.; None = the engine's default (tokenize text with the stage's
        tokenizer, or take the given ids/embeds). Called by StageEngine at admission and by its tokenize()
        (/tokenize); a model that overrides it renders its own prompt (StageInfo.renders_own_prompt)."""
        return None

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: "StageInput") -> None:
        """Called by StageEngine once per admitted request, before its first forward pass; `inp.sampling_params`
        is the request's resolved SamplingParams (the stage's defaults filled in)."""

    def remove_request(self, request_id: str) -> None:
        """Called by StageEngine once when a request leaves the stage (finished, aborted or failed)."""

    def extend_request(self, request_id: str, payload: "EdgePayload | None", last: bool) -> None:
        """A chunk of model-specific input for a request on a streaming edge (StageInput.payload of the
        processor's chunk form); `last`: nothing more will come. Called by StageEngine.extend_request for
        each chunk. Raise RequestError to refuse it."""
        if payload is not None:
            raise RequestError(f"payload: {type(self).__name__} takes no side input on a streaming edge",
                               field="payload")

    def compute_limit(self, request_id: str) -> int | None:
        """How many of the request's tokens can be computed with the input received so far (a model
        that decodes before its input is complete: info.decodes_before_input_complete); None: no limit.
        Called by StageEngine after add_request and after each extend_request (and after every step for a model
        with info.takes_input_after_output, whose limit moves as it replies)."""
        return None

    def take_input(self) -> dict[str, list[int]]:
        """The tokens each request's input grew by since the last call, after its outputs (info.takes_input_after_
        output: a model that renders each later input turn itself). Called by StageEngine after every step and
        every extend_request of such a model; the engine appends them to the request, to be computed, not sampled."""
        return {}


class OneShotStageModel(StageModel):
    """A model that turns one request into its output in one call (OneShotStageEngine)."""

    # info.streams_input True: it implements the streaming-input hooks below
    info = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=False)
    # True: a stream's piece takes several steps of work; the model implements the work-item hooks below
    # and the engine batches the items continuously across streams and steps (omni/engine/in_flight.py).
    pieces_span_steps = False
    max_model_len: int

    def prepare_generation(self, inp: "StageInput", seed: int) -> Any:
        """Validate a request when it arrives (raise ValueError naming the field); returns the job."""
        raise NotImplementedError

    def run_generation(self, job: Any) -> dict[str, Any]:
        """Run one job: {"audio": np.ndarray, ...}; other entries pass through to the output."""
        raise NotImplementedError

    # -- optional batched hooks --------------------------------------------------
    # A model that runs several jobs (or several streams' next pieces) in one call defines these;
    # left None, the engine calls run_generation / next_output one at a time. Each returns one
    # result per item, in order, equal to what the one-at-a-time hook returns for it, and computes
    # at most `max_batch_tokens` input tokens per model call (the stage's
    # scheduler.max_num_batched_tokens: the memory bound of a batch; an item larger than that runs
    # alone). When it raises, the engine runs the items one at a time, so that only a failing one
    # fails: next_outputs must then leave every state as it found it.
    #   run_generation_batch(jobs, max_batch_tokens) -> [run_generation(job) for job in jobs]
    #   next_outputs(states, max_batch_tokens) -> [next_output(state) for state in states]
    run_generation_batch: Callable[[list[Any], int], list[dict[str, Any]]] | None = None
    next_outputs: Callable[[list[Any], int], list[tuple[dict[str, Any] | None, bool]]] | None = None

    # -- streaming input (a model that can start before its whole input is there) --
    # On a streaming edge the engine calls prepare_stream with the first chunk (a request with
    # input_complete=False), extend_stream with each later one, and next_output whenever the
    # stream may have something ready; a model that cannot stream leaves these unimplemented
    # (config validation keeps streaming edges away from it: its info's `streams_input`).
    def prepare_stream(self, inp: "StageInput", seed: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot take a streaming input")

    def extend_stream(self, state: Any, inp: "StageInput", last: bool) -> None:
        raise NotImplementedError

    def stream_ready(self, state: Any) -> bool:
        """Whether next_output has something to produce now (cheap: called every step)."""
        raise NotImplementedError

    def next_output(self, state: Any) -> tuple[dict[str, Any] | None, bool]:
        """(the next piece of output, e.g. {"audio": ..., "sampling_rate": ...}; True once the stream is done)."""
        raise NotImplementedError

    def stream_result(self, state: Any) -> dict[str, Any]:
        """The whole output of a finished stream (what run_generation would return)."""
        raise NotImplementedError

    # -- pieces that take several steps (pieces_span_steps) ---------------------------------------
    # The engine owns what is in flight, how items pack into a step, the threads, and the pieces; the
    # model only computes. Its stream_ready(state) then says whether start_item has an item now; next_output
    # and stream_result go unused. Every hook but step_items and finish_item runs in the stepping thread.
    def start_item(self, state: Any) -> Any | None:
        """The stream's next work item (the work of its next piece), started; None while its input does not
        make one yet. Never called while the stream has an item in flight. Raising fails the stream."""
        raise NotImplementedError

    def item_size(self, item: Any) -> int:
        """The item's input tokens: what a step's budget (max_batch_tokens) and the packs' balance count."""
        raise NotImplementedError

    def step_items(self, items: list[Any]) -> None:
        """Advance the items (of any streams, each at its own point) one unit of work, in one packed call.
        May run on a worker thread beside another call on other items: touch only these items, and change
        none of them unless it succeeds (on a failure the engine steps each item alone)."""
        raise NotImplementedError

    def item_done(self, item: Any) -> bool:
        """Whether the item's work is done (an item may need no step at all: an empty last piece)."""
        raise NotImplementedError

    def end_item(self, item: Any) -> bool:
        """The item's work is done: its stream moves past it (its next item may start). True when it was
        the stream's last."""
        raise NotImplementedError

    def finish_item(self, item: Any) -> dict[str, Any]:
        """The item's piece of output, e.g. {"audio": samples, "sampling_rate": ...} (the post-processing
        step, e.g. a vocoder; may run on the engine's finish thread). The stream's output is its pieces'
        audio concatenated."""
        raise NotImplementedError


__all__ = ["AutoregressiveStageModel", "KVSpec", "OneShotStageModel", "PreparedPrompt", "StageModel"]
