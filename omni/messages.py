"""Typed messages that cross stage and process boundaries.

Everything here is plain data (numpy arrays, lists, str) so that it pickles
cheaply into Ray's object store: torch tensors never cross a process boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni.errors import OmniError, RequestAbortedError, as_omni_error


@dataclass(slots=True)
class MultiModalInput:
    """One multimodal input of a prompt: an image as an HxWxC array, audio as a waveform, a video as its encoded
    file (1-D uint8: the bytes of an mp4, webm, ...) or as decoded frames (TxHxWxC uint8, with their `fps`;
    without one, every frame is taken as sampled at the model's rate)."""

    modality: str  # "image" | "audio" | "video"
    data: np.ndarray
    sampling_rate: int | None = None  # audio only
    fps: float | None = None  # video frames only


@dataclass(slots=True)
class EdgePayload:
    """Base of the typed side input an edge's input processor hands a downstream stage model: what the model
    needs besides token ids and prompt embeddings (a talker's thinker rows, a vocoder's codec frames).

    Each edge kind is a subclass (stages/<family>/payloads.py), read by the stage model it feeds: in
    `StageInput.payload` with a request, and again with each later chunk on a streaming edge (the engine's
    `extend_request(payload=...)`). Plain data only (numpy arrays, lists, str): it pickles across Ray.
    """


# StageInput.extra's key for a request's own reference voice (a MultiModalInput of audio; its transcript is
# extra["reference_text"]): a voice agent's speech stage speaks in it (stages/higgs_audio_v2/speak_edges.py)
REFERENCE_AUDIO = "reference_audio"


@dataclass(slots=True)
class StageInput:
    """What a stage receives for one request.

    The entry stage gets the user's prompt (text or token ids); a downstream
    stage gets what its edge's input processor made of the upstream outputs
    (token ids and/or prompt embeddings).
    """

    request_id: str
    prompt: str | list[dict[str, Any]] | None = None  # text, or chat messages
    prompt_token_ids: list[int] | None = None
    # [num_prompt_tokens, hidden] float32: for stages fed with embeddings
    # (a talker conditioned on the thinker's hidden states).
    prompt_embeds: np.ndarray | None = None
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    # A SamplingParams, or a dict validated into one by the stage; None -> stage defaults.
    sampling_params: Any = None
    cache_salt: str | None = None
    # The caller's per-request options for stages past the entry stage (the API's voice as "speaker", or a
    # voice's own clip as REFERENCE_AUDIO with its "reference_text"; "<stage>_sampling_params"): input processors
    # read them and hand what a model needs on.
    extra: dict[str, Any] = field(default_factory=dict)
    # What an input processor made of the upstream outputs for this stage's model, typed per edge kind.
    payload: EdgePayload | None = None
    # Hand this request's per-token rows (hidden states, mm_outputs) out with its output.
    # None: the stage's default (StageEngineConfig.emit_hidden_states); the pipeline sets it.
    return_hidden_states: bool | None = None
    # Report progress every step (StageDelta: new tokens, text delta, rows computed).
    stream: bool = False
    # False: the prompt is the first chunk of a growing input (a streaming edge);
    # more comes through extend_request(), the last one with last=True.
    input_complete: bool = True
    # Functions the model may call (OpenAI's `tools`, JSON schemas): given to the stage's chat template with
    # the chat messages (a stage whose prompt renderer takes none refuses them, naming `tools`).
    tools: list[dict[str, Any]] | None = None
    # False: a text prompt is tokenized as it is, even on a stage with `use_chat_template` (the completions
    # endpoint's prompt, as vLLM's: no template); None: the stage's config decides.
    chat_template: bool | None = None
    # Extra variables for the chat template (vLLM's chat_template_kwargs: enable_thinking, ...); a template that
    # does not use one ignores it. Stages that render their own prompt take none.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's mm_processor_kwargs: how the stage's processor treats the media (`use_audio_in_video`: a video's
    # audio track interleaved with its frames by time); a stage refuses keys it does not take, naming them.
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class CacheReport:
    """What a stage's prefix cache lost since the stage's previous report: rides on the driver's summary
    of a finished request, so that a router's picture of each replica's cache stays true."""

    evicted: list[bytes] = field(default_factory=list)  # block hashes no longer cached
    # More evictions than were logged (or a cache reset): nothing known of the cache still stands.
    overflow: bool = False


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens at its step (SamplingParams.logprobs:
    how many), from the model's raw logits (before penalties, bias and temperature: vLLM's default). `token`
    is the token's text decoded alone (None on a stage without a tokenizer); `token_bytes` its raw bytes
    (engine/token_bytes.py: a token holding part of a UTF-8 character decodes alone to U+FFFD, its bytes
    are still its own)."""

    token_id: int
    logprob: float
    token: str | None = None
    # (id, logprob, text, raw bytes), best first; text and bytes None on a stage without a tokenizer
    top: list[tuple[int, float, str | None, bytes | None]] = field(default_factory=list)
    rank: int | None = None  # 1 + the tokens more likely than this one (prompt logprobs: vLLM's `rank`)
    token_bytes: bytes | None = None


@dataclass(slots=True)
class StageOutput:
    """What a stage emits for one request (finished, or a streamed chunk)."""

    request_id: str
    stage: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # generated tokens
    text: str | None = None
    finished: bool = True
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # vLLM's stop_reason: the stop string (SamplingParams.stop) or stop token id (stop_token_ids) that ended the
    # reply; None for eos, max_tokens or anything else
    stop_reason: str | int | None = None
    error: OmniError | None = None  # typed (stage, field, code, numbers): it pickles across Ray as itself
    # Rows for every computed token of the sequence (prompt + generated, the
    # last sampled token excluded: it was never fed through the model):
    # cached rows + fresh rows, in order.
    hidden_states: np.ndarray | None = None
    # Per-token outputs the stage model produced besides the hidden states
    # (discovered at run time), same row layout as hidden_states.
    mm_outputs: dict[str, np.ndarray] = field(default_factory=dict)
    # Per-request outputs that are not per-token (1-D metadata): passed through.
    passthrough: dict[str, Any] = field(default_factory=dict)
    audio: np.ndarray | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # ttft_s, e2e_s, ...
    cache_report: CacheReport | None = None  # on summaries for the driver (stage_worker.py)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked for them
    # One per prompt token (None for the first: nothing precedes it), when the request asked (prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The prompt decoded, when the request asked (SamplingParams.echo_prompt); with prompt_logprobs too, each
    # prompt token decoded alone (the first one's text, which prompt_logprobs has no entry for, included).
    prompt_text: str | None = None
    prompt_token_texts: list[str] | None = None
    # The prompt's placeholder tokens per modality ({"audio": 750, "image": 6}; the rest is text) and how many of
    # them the prefix cache held (usage's audio / image / cached token details)
    prompt_mm_tokens: dict[str, int] = field(default_factory=dict)
    cached_mm_tokens: dict[str, int] = field(default_factory=dict)
    # On a final stage's output (the orchestrator sets it): the tokens each stage this one takes its input from
    # generated for the request, by stage name. A vocoder's output is the only one the caller gets of a talker's
    # work, so this is where the talker's codec tokens reach usage (OpenAI's audio tokens).
    upstream_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class StageDelta:
    """What one step changed for one streamed request at one stage (StageInput.stream)."""

    request_id: str
    stage: str
    token_ids: list[int] = field(default_factory=list)  # tokens generated this step
    text: str = ""  # their text, once it is final (incremental detokenization)
    num_prompt_tokens: int = 0
    # Tokens whose rows exist now: rows [0, num_computed_tokens) can be read.
    num_computed_tokens: int = 0
    finished: bool = False  # the step that finished it (its StageOutput follows)
    # Per-token rows of a range of tokens (filled where a consumer needs them): name -> [n, ...].
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    rows_start: int = 0  # token index of the first row in `rows`
    # The request's prompt, on its first delta only (a streaming consumer may need it).
    prompt_token_ids: list[int] | None = None
    # A piece of waveform (float32, mono) ready now (a stage that streams audio out).
    audio: np.ndarray | None = None
    sampling_rate: int | None = None
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked for them
    # With SamplingParams.echo_prompt, on the first delta that carries generated tokens: what the finished
    # StageOutput reports of the prompt (its text; with prompt_logprobs, each token's text and logprob).
    prompt_text: str | None = None
    prompt_token_texts: list[str] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On its first delta, with the prompt ids: what the finished StageOutput reports of the prompt's tokens (its
    # prefix-cache hit, its multimodal placeholder tokens per modality and those of them cached), known from the
    # request's first scheduling on. A caller that leaves before the end (a cancelled reply) still has them.
    num_cached_tokens: int | None = None
    prompt_mm_tokens: dict[str, int] | None = None
    cached_mm_tokens: dict[str, int] | None = None


def error_output(stage: str, request_id: str, error: OmniError | str, reason: str = "error") -> StageOutput:
    """The terminal output of a request that failed (reason "error") or was aborted ("abort") at `stage`.
    A text is the stage's own account of what broke: a StageError (a RequestAbortedError for an abort)."""
    if isinstance(error, str) and reason == "abort":
        error = RequestAbortedError(error, stage=stage, request_id=request_id)
    err = as_omni_error(error, stage, request_id)
    if err.stage is None:
        err = err.replace(stage=stage)
    return StageOutput(request_id, stage, finished=True, finish_reason=reason, error=err)


@dataclass(slots=True)
class RequestOutput:
    """The caller's result for one request: the outputs of every final stage."""

    request_id: str
    prompt: Any = None
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    finished: bool = True
    error: OmniError | None = None  # why it failed: a RequestError (the caller's), a StageError, a timeout, ...

    def _first(self) -> StageOutput | None:
        return next(iter(self.outputs.values()), None)

    @property
    def text(self) -> str | None:
        out = self._first()
        return out.text if out is not None else None

    @property
    def token_ids(self) -> list[int]:
        out = self._first()
        return out.token_ids if out is not None else []
