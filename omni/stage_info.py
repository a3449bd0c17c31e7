"""StageInfo: what the runtime knows of a stage model without running it.

One typed record per stage model class (`StageModel.info`), declared once: a registered model's
registration hands the registry the very object its class declares (omni/registry.py says why), so
that validating a config reads the same facts the engine runs by, with no torch imported. A loaded
model may fill in what only its checkpoint knows (a talker's voices); its engine fills in what the
stage's config decides (the max_model_len in force, whether the model renders its own prompt).

The pipeline reads each stage's StageInfo once, when it starts (Backend.infos: in-process, or one
call per stage actor on Ray), and `Omni.voices()` / `context_reserve()` / `min_spoken_tokens()` /
`shows_tools()` / `input_media()` and the server's PipelineInfo answer from it; `stats()` holds counters only.

Torch-free: omni/config and omni/registry import it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageInfo:
    # -- declared by the stage model class ------------------------------------------------------
    # It has a KV cache and runs token by token (StageEngine); False: one call per request (OneShotStageEngine).
    autoregressive: bool = True
    # It emits per-token last hidden states a downstream stage (or a caller, final_output: hidden) can read.
    emits_hidden_states: bool = True
    # Its input may arrive in chunks (a streaming edge into it): every autoregressive model; a one-shot
    # model only when it implements the streaming-input hooks.
    streams_input: bool = True
    # On a streaming edge: True when the model may sample while its input is still arriving (a talker
    # consumes one thinker row per step and says how far it can go through `compute_limit`); False: a
    # growing prompt is only prefilled, and decoding starts once the input is complete.
    decodes_before_input_complete: bool = False
    # Its input may go on after it has replied (a TTS speaking an LLM's reply piece by piece in one request: each
    # piece a new turn after the audio of the last): the model renders each turn itself and hands the engine its
    # tokens through `take_input`; they follow the outputs as tokens the request did not sample.
    takes_input_after_output: bool = False
    # A model whose `preprocess` renders its own prompt from chat messages: True when that rendering shows
    # the model the request's `tools`; else a request with tools is refused, naming the field.
    renders_tools: bool = False
    # Its prompt is a conversation whose `tools` are for the stage after it (a voice agent's recognizer, which hears
    # the last turn's clip and hands the conversation on): a request with tools is not refused here, and whether
    # they reach a model is the next stage's to say (Omni.shows_tools).
    passes_tools_on: bool = False
    # The multimodal inputs its own prompt takes ("image", "audio"; its `preprocess` renders them); None: not
    # declared (its preprocess decides). A model that renders no prompt of its own takes none (`input_media`).
    media: tuple[str, ...] | None = None
    # The fewest upstream tokens it needs to produce anything as the upstream generates (a talker's 2: it
    # voices each reply token from the row of the next one); `omni serve` voices a shorter reply once whole.
    min_upstream_tokens: int = 1
    # A text-to-speech model: its prompt is the text it speaks (a voice in `extra["speaker"]`, a style in
    # `extra["instructions"]`); `omni serve`'s speech endpoint hands it `input` as it is, no reply forced.
    speaks_prompt: bool = False
    # A speech-recognition model: its prompt is the clip (`mm_inputs`), a text `prompt` the context it is given and
    # `mm_processor_kwargs.language` the language it is told; `omni serve`'s transcription endpoint hands it the
    # clip so, instead of asking a chat model to write the audio down.
    transcribes_audio: bool = False
    # Its reply leads with a tag (the language it heard) ended by this marker; the transcript is what follows (the
    # whole reply when the marker never comes). None: the whole reply is the transcript.
    transcript_marker: str | None = None
    # -- filled in by a loaded model ------------------------------------------------------------
    # The voices it speaks in (a talker's speakers, from its checkpoint): what `omni serve` checks a
    # request's voice against; () for a model that names none.
    voices: tuple[str, ...] = ()
    # -- filled in by the stage's engine ----------------------------------------------------------
    # The max_model_len in force (the config's, capped by the model's and the KV cache's); None: not known.
    max_model_len: int | None = None
    # The model turns a request's text or chat messages into its prompt itself (its own `preprocess`).
    renders_own_prompt: bool = False

    @property
    def shows_tools(self) -> bool | None:
        """Whether a request's `tools` reach the model: `renders_tools` for a model that renders its own
        prompt; None when the stage's chat template renders it (the template decides)."""
        return self.renders_tools if self.renders_own_prompt else None

    @property
    def input_media(self) -> tuple[str, ...] | None:
        """The multimodal inputs a request may hold for it: `media` for a model that renders its own prompt; ()
        for one that does not (its prompt is text or token ids: admission refuses media); None: not declared."""
        return self.media if self.renders_own_prompt else ()


__all__ = ["StageInfo"]
