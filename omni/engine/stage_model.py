"""The interface between the engines and model-specific stage models (in `stages/`).

The runtime knows nothing model-specific. A stage model is one of two kinds, each
run by its own engine (the pipeline's engine factory picks it from the registry):

    AutoregressiveStageModel   StageEngine: KV cache, scheduler, prefix caching;
                               embed / packed forward / logits, per-request hooks
    OneShotStageModel          OneShotStageEngine: one call per request
                               (e.g. token2wav: codec tokens -> waveform)

Whatever per-token tensors `forward` returns besides `hidden_states` are
discovered by the runner and cached/concatenated like hidden states (see
tensor_cache.py). Every hook an engine calls is declared here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

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


class StageModel:
    """What every stage model has: loading, its device/dtype/tokenizer, and stats."""

    # Facts the registry also records for registered models (omni/registry.py).
    autoregressive: bool
    emits_hidden_states: bool

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
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Model-specific counters merged into the stage's stats (e.g. encoder cache hits)."""
        return {}


class AutoregressiveStageModel(StageModel):
    """A model run token by token by StageEngine. Subclasses implement every method up to the hooks."""

    autoregressive = True
    emits_hidden_states = True
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
    # On a streaming edge: True when the model may sample while its input is still
    # arriving (Qwen2.5-Omni's talker consumes one thinker row per step and says how
    # far it can go through `compute_limit`); False: a growing prompt is only
    # prefilled, and decoding starts once the input is complete.
    decodes_before_input_complete: bool = False
    # A model whose `preprocess` renders its own prompt from chat messages: True when that rendering shows the
    # model the request's `tools` (StageInput.tools); else a request with tools is refused, naming the field.
    renders_tools: bool = False

    hidden_size: int  # width of the last hidden states it emits
    # Width of rows accepted as `prompt_embeds` when it differs from
    # hidden_size (a talker fed a wider thinker's embeddings); None = hidden_size.
    prompt_embed_size: int | None = None
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None

    def kv_spec(self) -> KVSpec:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """One packed varlen forward pass over T tokens (exactly one of
        input_ids [T] / inputs_embeds [T, hidden]). Returns at least
        "hidden_states": [T, hidden] (the last hidden states)."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        raise NotImplementedError

    def prepare_cuda_graphs(self, max_num_seqs: int) -> None:
        """Before capture: allocate the persistent device buffers a captured forward reads (their addresses are
        baked into the graphs)."""

    def before_graph_replay(self, req_ids: list[str], padded: int) -> None:
        """Before a graph replays a decode step of `req_ids` (rows in order; `padded` rows in all): fill the
        buffers of `prepare_cuda_graphs` for these rows."""

    # -- optional hooks (multimodal / model-specific stages) -----------------
    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> "StageGeometry | None":
        """Cache geometry (layers, KV heads, head dim, hidden size) read from the checkpoint's config
        without loading weights, so that the engine refuses caches the machine cannot hold before it
        loads the model (omni/engine/memory.py). None: known only once loaded."""
        return None

    def preprocess(self, inp: "StageInput") -> PreparedPrompt | None:
        """Turn a request into token ids etc.; None = the engine's default
        (tokenize text with the stage's tokenizer, or take the given ids/embeds)."""
        return None

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: "StageInput") -> None:
        """Called once per admitted request, before its first forward pass; `inp.sampling_params` is the
        request's resolved SamplingParams (the stage's defaults filled in)."""

    def remove_request(self, request_id: str) -> None:
        """Called once when a request leaves the stage (finished, aborted or failed)."""

    def extend_request(self, request_id: str, payload: "EdgePayload | None", last: bool) -> None:
        """A chunk of model-specific input for a request on a streaming edge (StageInput.payload of the
        processor's chunk form); `last`: nothing more will come. Raise ValueError to refuse it."""
        if payload is not None:
            raise ValueError(f"payload: {type(self).__name__} takes no side input on a streaming edge")

    def compute_limit(self, request_id: str) -> int | None:
        """How many of the request's tokens can be computed with the input received so far (a model
        that decodes before its input is complete); None: no limit."""
        return None


class OneShotStageModel(StageModel):
    """A model that turns one request into its output in one call (OneShotStageEngine)."""

    autoregressive = False
    emits_hidden_states = False
    streams_input = False  # True: implements the streaming-input hooks below
    # True: next_outputs advances the pieces in flight by one unit of work per call and answers
    # (None, False) for a stream whose piece is not done; it takes every stream with work (first pieces
    # first) and orders the work itself (OneShotStageEngine); drop_stream(state) forgets an aborted one.
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
    # (config validation keeps streaming edges away from it: registry `streams_input`).
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


__all__ = ["AutoregressiveStageModel", "KVSpec", "OneShotStageModel", "PreparedPrompt", "StageModel"]
