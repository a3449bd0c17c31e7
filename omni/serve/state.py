"""What every endpoint shares: the pipeline as the server sees it (PipelineInfo), the server's state
(ServerState: the pipeline, the settings, the metrics, the admission count, the drain) and the transcripts of
its recent spoken replies (AudioTranscripts).

AudioTranscripts: a spoken chat reply carries `audio.id` and `audio.expires_at`; OpenAI's clients continue the
conversation with an assistant message `{"role": "assistant", "audio": {"id": ...}}` until then, and the server
puts that reply back into the prompt. What the omni thinkers take for an earlier assistant turn is its text,
so the server keeps each reply's transcript (text, not audio: a few hundred bytes) until its
`expires_at`, at most `max_entries` of them (the oldest leave first). An id this server does not know
(expired, evicted, or minted by another server process) is a 400 naming the message's `audio.id`: the
client can send the transcript as the message's content instead.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from omni.async_api import AsyncOmni
from omni.config.schema import PipelineConfig
from omni.serve.http.errors import ApiError, bad_request
from omni.serve.http.metrics import ServerMetrics
from omni.serve.http.shutdown import Drain
from omni.serve.settings import ServeSettings
from omni.serve.voices.store import UploadedVoices

# OpenAI's voice names (chat audio.voice, /v1/audio/speech, realtime): --voice-map may map them to the pipeline's
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                           "sage", "shimmer", "verse"})
AUDIO_TTL_S = 3600  # `expires_at` of a reply's audio (OpenAI's field): its transcript is kept as long


@dataclass(slots=True)
class PipelineInfo:
    """What the server needs to know of the pipeline (from its config)."""

    model: str
    stages: list[str]  # config order: the order of sampling_params_list
    entry_stage: str
    text_stage: str | None  # its text is the reply's content
    audio_stage: str | None  # its audio is the reply's audio
    # The voices its stages speak in (their StageInfo's `voices`, read once at start: Omni.voices()); () when no
    # stage names them, and then a request's voice is left to the stage that takes it
    voices: tuple[str, ...] = ()
    # False: the entry stage's model renders its own prompt without tools (Qwen2.5-Omni's thinker): a request
    # with tools is refused at the edge; None: not known (the stage decides)
    shows_tools: bool | None = None
    # Tokens of the text stage's context a spoken reply leaves free for the stages after it (Omni.context_reserve)
    context_reserve: int = 0
    # The fewest tokens of a text-stage reply the stages after it can voice as it is generated
    # (Omni.min_spoken_tokens: 2 for a talker, which voices every reply token but the last)
    min_spoken_tokens: int = 1
    # The multimodal inputs ("image", "audio") a prompt may hold (Omni.input_media): media of another kind is
    # refused at the edge; None: not known (the stage decides)
    media: tuple[str, ...] | None = None
    # --voice-map: OpenAI's voice names (lower case) -> the pipeline's voices; empty: off (such a name is refused)
    voice_map: dict[str, str] = field(default_factory=dict)
    # The entry stage is a text-to-speech model (Omni.speaks_prompt): speech requests hand it `input` as its prompt
    speaks_prompt: bool = False
    # The entry stage is a speech recognizer (Omni.transcribes_audio): a transcription hands it the clip as its prompt
    transcribes_audio: bool = False
    # What ends the language tag its replies lead with (Omni.transcript_marker): the transcript follows it
    transcript_marker: str | None = None
    # A voice agent's cascade (ASR -> LLM -> TTS): the entry stage, a speech recognizer with stages after it. Its
    # transcript of the user's speech is the user's turn, the reply's text is the text stage after it (text_stage),
    # and the voice is the speech stage's, whose `voices` are all it knows (none: it speaks its default voice only)
    recognizer: str | None = None
    # A request may hand the stage that speaks a reference clip of its own (Omni.clones_voices: a text-to-speech
    # model that takes audio): POST /v1/audio/voices takes uploads, and a request may name one
    clones_voices: bool = False

    @classmethod
    def of(cls, config: PipelineConfig, served_model_name: str | None = None, voices: tuple[str, ...] = (),
           shows_tools: bool | None = None, context_reserve: int = 0, min_spoken_tokens: int = 1,
           media: tuple[str, ...] | None = None, transcribes_audio: bool = False,
           transcript_marker: str | None = None) -> "PipelineInfo":
        finals = {s.name: s.final_output for s in config.stages}
        entry = next(s.name for s in config.stages if not s.inputs)
        # the entry stage transcribes audio and stages follow it: a cascade, whose reply is the stages' after it
        recognizer = entry if transcribes_audio and len(finals) > 1 else None
        first = lambda kind: next((n for n, k in finals.items() if k == kind and n != recognizer), None)  # noqa: E731
        if recognizer is not None:
            # Omni.context_reserve is the room a talker needs in its thinker's context (its prompt is the thinker's
            # sequence); a cascade's speech stage reads the reply's text as its own prompt: the LLM keeps its context
            context_reserve = 0
        return cls(served_model_name or config.name, list(finals), entry, first("text"), first("audio"),
                   tuple(voices), shows_tools, context_reserve, min_spoken_tokens, media,
                   transcribes_audio=transcribes_audio, transcript_marker=transcript_marker, recognizer=recognizer)

    def takes(self, kind: str) -> bool:
        """Whether a prompt may hold media of `kind` ("image", "audio"); True when the pipeline does not say."""
        return self.media is None or kind in self.media

    def speaker(self, voice: str | None) -> str | None:
        """The pipeline's voice a request's `voice` names: itself, or what --voice-map maps it to."""
        return None if voice is None else self.voice_map.get(voice.lower(), voice)

    def unknown_voice(self, voice: str | None, field: str) -> str | None:
        """Why `voice` cannot be spoken (the message, naming `field`), or None: checked before any stage runs,
        so that a stream never starts for a voice its talker would refuse (matched case-insensitively, as the
        talkers match it, after --voice-map)."""
        spoken = self.speaker(voice)
        if spoken is None or spoken.lower() in (v.lower() for v in self.voices):
            return None
        if not self.voices and self.recognizer is None:  # the stage that takes the voice decides
            return None
        if not self.voices:  # a cascade's speech stage knows the voices it names (Higgs: --voice-dir's clips)
            return (f"{field}: {voice!r} is not a voice of this pipeline: its speech stage names no voices (start the "
                    "server with --voice-dir to clone some); leave the voice unset for its default voice")
        hint = ""
        if voice.lower() in OPENAI_VOICES and not self.voice_map:
            hint = (f"; OpenAI's voice names map to this pipeline's with `omni serve --voice-map "
                    f"{voice.lower()}={self.voices[0]},...`")
        return f"{field}: {voice!r} is not a voice of this pipeline; choose one of {list(self.voices)}{hint}"



def checked_voice_map(voice_map: dict[str, str], info: PipelineInfo) -> dict[str, str]:
    """--voice-map, each voice it maps to one of the pipeline's (ConfigError naming the option otherwise)."""
    lower = {v.lower() for v in info.voices}
    for name, voice in voice_map.items():
        if voice.lower() not in lower:
            from omni.errors import ConfigError

            raise ConfigError(f"--voice-map: {name}={voice}: {voice!r} is not a voice of pipeline {info.model!r}"
                              + (f"; one of {list(info.voices)}" if info.voices else " (it names none)"),
                              field="--voice-map")
    return dict(voice_map)


def check_model(name: str, info: PipelineInfo) -> None:
    if name != info.model:
        raise ApiError(404, f"The model `{name}` does not exist (this server serves `{info.model}`).",
                       param="model", code="model_not_found")


class Finished(Protocol):
    """What a finished reply tells the metrics (a Run, a chat request's Choices, a segmented transcription)."""

    t0: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


class AudioTranscripts:
    def __init__(self, ttl_s: float, max_entries: int = 10_000, clock=time.time):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires_at, transcript)

    def put(self, audio_id: str, transcript: str, expires_at: float) -> None:
        with self._lock:
            self._items[audio_id] = (expires_at, transcript)
            self._items.move_to_end(audio_id)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        """The transcript of a reply's audio, or None once it expired or when it is unknown here."""
        with self._lock:
            item = self._items.get(audio_id)
            if item is None:
                return None
            if item[0] <= self._clock():
                del self._items[audio_id]
                return None
            return item[1]

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ServerState:
    """What the endpoints share: the pipeline, the settings, the metrics, the admission count, the drain."""

    omni: AsyncOmni
    settings: ServeSettings
    info: PipelineInfo
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    pending: int = 0
    drain: Drain = field(default_factory=Drain)
    # The transcripts of the spoken replies this server gave, by audio id, until their expires_at
    audio_transcripts: AudioTranscripts = field(default_factory=lambda: AudioTranscripts(AUDIO_TTL_S))
    # Reference voices uploaded to this server (POST /v1/audio/voices), for a pipeline that clones voices
    uploaded_voices: UploadedVoices = field(default_factory=UploadedVoices)

    @property
    def max_pending(self) -> int:
        return self.omni.config.runtime.max_pending_requests

    def admit(self, count: int = 1, what: str | None = None, param: str = "n") -> None:
        """Room for `count` pipeline requests (a request's n choices, of each of its prompts), or 503; more than
        the limit itself could never fit: 400 naming `param` (`n`; `prompt` for a batch), `what` saying why."""
        if count > self.max_pending:
            raise bad_request(f"{param}: {what or f'{count} choices'} are {count} pipeline requests, more than this "
                              f"server runs at once ({self.max_pending}, runtime.max_pending_requests)", param,
                              "invalid_value")
        if self.pending + count > self.max_pending:
            raise ApiError(503, f"the server is running {self.pending} requests, its limit "
                           f"(runtime.max_pending_requests) is {self.max_pending}; retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": str(self.settings.retry_after_s)})
        self.pending += count
        self.metrics.pending.set(self.pending)

    def release(self, run: Finished | None, finish_reason: str, count: int = 1) -> None:
        self.pending -= count
        self.metrics.pending.set(self.pending)
        if run is not None:
            self.metrics.request_done(finish_reason, time.monotonic() - run.t0, run.prompt_tokens,
                                      run.completion_tokens, run.cached_tokens)

