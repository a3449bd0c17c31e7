"""One Job through AsyncOmni.stream: the text and audio a reply is made of, as they arrive.

    run = Run(omni, job, ...)
    await run.start()              # submitted and alive, or ApiError (bad request, refused at admission)
    async for ev in run.events():  # TextEvent / AudioEvent, then run.finish_reason and the usage are set
        ...

The run ends as soon as the reply is complete (the text stage finished, and the audio stage when audio
is wanted): whatever else the pipeline would still compute for it (a talker whose tokens nobody asked
for, the audio of a text-only reply) is aborted on every stage, as is everything when the caller leaves
early (closing `events()`, a cancelled task, a client that disconnected).

Audio goes out as soon as the pipeline yields it: a StageDelta carrying `audio` (stages that stream
their waveform in chunks) is forwarded at once; a final StageOutput's `audio` is forwarded past what
the deltas already carried (the whole waveform of a one-shot stage).

A reply that may be a tool call and is to be spoken (chat's tool_choice "auto" with audio out, Job.voice_after)
runs text only; once its text is whole and holds no call, a second request voices it: the same prompt (a
prefix-cache hit) with the text stage's reply forced to that text, the audio stage's audio then follows the
text. A call is never voiced (it has no speech). A spoken reply bounded to fewer tokens than the audio stages
can voice (translate.voice_short_replies) is voiced that way too: the forced reply is its text and an
end-of-sequence token, enough for the talker, which voices every reply token but the last.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import numpy as np

from omni.async_api import AsyncOmni
from omni.errors import REPLY_TOO_SHORT_TO_VOICE, BackendClosedError, OmniError
from omni.messages import StageDelta, StageOutput, TokenLogprob
from omni.serve.generation.job import Job
from omni.serve.generation.tool_parser import parse_tool_calls
from omni.serve.http.errors import ApiError, from_omni_error, internal


@dataclass(slots=True)
class TextEvent:
    text: str  # may be "" (tokens whose text is not final yet): still a sign of progress
    logprobs: list[TokenLogprob] | None = None  # of the tokens this piece came with, when the request asked
    # completions' echo: the prompt as the text stage saw it, sent before the reply (its tokens' texts and
    # logprobs, when asked, are the Run's prompt_token_texts / prompt_logprobs by then)
    echo: bool = False


@dataclass(slots=True)
class AudioEvent:
    samples: np.ndarray  # float32, mono
    rate: int


@dataclass(slots=True)
class HeardEvent:
    """A piece of what the recognizer ahead of the text stage heard (Job.heard_stage); `done`: its reply is whole,
    and the Run's `heard` holds its token counts."""

    text: str
    done: bool = False


@dataclass(slots=True)
class StageUsage:
    """One stage's token counts (the recognizer's, for its transcript's usage)."""

    prompt_tokens: int
    completion_tokens: int
    prompt_mm_tokens: dict[str, int]


class Observer(Protocol):
    def first_token(self, stage: str, seconds: float) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


class StopMatcher:
    """Stop strings on streamed text: text that may be the start of a stop string is held back until
    it is not; at a stop string the text ends (the stop string excluded), as in vLLM."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self._buf += text
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buf = self._buf[: min(hits)], ""
            return out
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class Run:
    """One request's run; see the module docstring."""

    def __init__(self, omni: AsyncOmni, job: Job, default_rate: int, observer: Observer | None = None):
        self.omni = omni
        self.job = job
        self.t0 = time.monotonic()
        self.default_rate = default_rate
        self.observer = observer
        self.text = ""  # the reply's text so far (stop strings applied)
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0  # the text stage's reply
        # The codec tokens the reply's audio was decoded from (its talker's, voicing included): OpenAI's audio tokens
        self.audio_tokens = 0
        # known from the text stage's first delta (its prompt was read: a cancelled reply's usage still counts it)
        self.cached_tokens: int | None = None
        # the prompt's audio / image placeholder tokens, and those of them the cache held (known with cached_tokens)
        self.prompt_mm_tokens: dict[str, int] = {}
        self.cached_mm_tokens: dict[str, int] = {}
        self.logprobs: list[TokenLogprob] | None = None  # the reply tokens', when the request asked
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt tokens', when asked
        # The prompt decoded, whole and token by token (SamplingParams.echo_prompt: completions' echo)
        self.prompt_text: str | None = None
        self.prompt_token_texts: list[str] | None = None
        self._stop = StopMatcher(job.stops)
        self._agen: Any = None
        self._first: StageDelta | StageOutput | None = None
        self._done: set[str] = set()
        self._ttft_seen: set[str] = set()
        self._audio_sent = 0
        self._audio_seen = False
        self.voiced = False  # Job.voice_after: the reply's text held no tool call and was voiced
        self.stop_reason: str | int | None = None
        self._voice_whole = False  # the talker refused a reply too short to voice as it came: voiced once whole
        self._voice: Run | None = None
        self._heard_text = ""
        self.heard: StageUsage | None = None  # the recognizer's counts, once its reply is whole (Job.heard_stage)
        wanted = {job.usage_stage} | ({job.audio_stage} if job.audio_stage else set())
        wanted |= {job.heard_stage} if job.heard_stage else set()
        self._wanted = frozenset(wanted)

    @property
    def complete(self) -> bool:
        return self._stop.stopped or self._wanted <= self._done

    def _error(self, err: OmniError) -> ApiError:
        return from_omni_error(err, self.job.fields, self.job.sampling_param)

    async def start(self) -> None:
        """Submit the request and wait for its first item: raises ApiError when it is refused (a bad field
        at the edge, or at the entry stage's admission) or failed before producing anything."""
        try:
            # A reply without audio runs the stages its text stage needs, never the audio stages (whose failure
            # on a reply they were not asked to voice, e.g. a one-token one, would fail the request), nor a text
            # stage after it (a voice agent's transcription runs its recognizer, not the LLM behind it).
            text_only = self.job.text_stage is not None and self.job.audio_stage is None
            self._agen = self.omni.stream(self.job.prompt, self.job.sampling or None, request_id=self.job.request_id,
                                          output_modalities=[self.job.text_stage] if text_only else None)
            self._first = await self._agen.__anext__()
        except BackendClosedError as e:
            raise ApiError(503, f"the pipeline is shutting down: {e}", type="server_error",
                           code="shutting_down") from None
        except OmniError as e:  # refused at the edge (a RequestError naming its field), or failed (a 500)
            raise self._error(e) from None
        except StopAsyncIteration:
            raise internal("the pipeline ended the request without any output") from None
        if isinstance(self._first, StageOutput) and self._first.error is not None:
            await self.aclose()
            raise self._error(self._first.error)

    async def events(self) -> AsyncIterator[TextEvent | AudioEvent | HeardEvent]:
        """The reply's pieces as they come; raises ApiError when the request fails midway."""
        item, self._first = self._first, None
        try:
            while item is not None:
                for ev in self._on(item):
                    yield ev
                if self.complete:
                    break
                item = await anext(self._agen, None)
            if not self.complete:
                raise internal("the pipeline ended the request before its reply was complete")
        finally:
            await self.aclose()
        if ((self.job.voice_after is not None or self._voice_whole) and self.text.strip()
                and (self.job.tool_parser is None or parse_tool_calls(self.text)[1] is None)):
            async for ev in self._voiced():
                yield ev

    async def _voiced(self) -> AsyncIterator[AudioEvent]:
        """The reply's text voiced (Job.voice_after): the same prompt, the text stage's reply forced to that
        text (prefilled in one pass after the prompt, which its prefix cache holds), the audio stage's audio."""
        job = self.job
        stage = job.usage_stage
        sampling = {s: dict(p) for s, p in job.sampling.items() if s != stage}
        sampling[stage] = {"forced_text": self.text}
        where = job.fields.get("prompt", "messages")  # what holds the reply's text: chat's messages, a conversation
        voice = dataclasses.replace(job, request_id=f"{job.request_id}-voice", sampling=sampling, text_stage=None,
                                    audio_stage=job.voice_after or job.audio_stage, voice_after=None, tool_parser=None,
                                    stops=[],
                                    fields={**job.fields, "forced_text": where, "max_tokens": where})
        self._voice = run = Run(self.omni, voice, self.default_rate)
        self.voiced = True
        try:
            await run.start()
            async for ev in run.events():
                if isinstance(ev, AudioEvent):
                    if not self._audio_seen and self.observer is not None:
                        self.observer.first_audio(time.monotonic() - self.t0)
                    self._audio_seen = True
                    yield ev
            self.audio_tokens = run.audio_tokens  # the voicing's thinker tokens were forced: the reply counts once
        finally:
            self._voice = None
            await run.aclose()

    async def aclose(self) -> None:
        """Leave the request (aborted on every stage where it still runs). Shielded: it also runs inside a
        cancelled scope (a client that went away)."""
        agen, self._agen = self._agen, None
        if agen is not None:
            if self.complete:  # what still runs was not asked for: the request counts finished, not aborted
                self.omni.complete(self.job.request_id)
            with anyio.CancelScope(shield=True):
                await agen.aclose()
        if self._voice is not None:
            await self._voice.aclose()

    # ------------------------------------------------------------ items
    def _on(self, item: StageDelta | StageOutput) -> list[TextEvent | AudioEvent | HeardEvent]:
        job, out = self.job, []
        if item.stage == job.heard_stage and job.heard_stage is not None:
            return self._heard(item)
        if isinstance(item, StageDelta):
            if item.token_ids and item.stage not in self._ttft_seen:
                self._ttft_seen.add(item.stage)
                if self.observer is not None:
                    self.observer.first_token(item.stage, time.monotonic() - self.t0)
            if job.audio_stage is not None and item.stage not in (job.usage_stage, job.audio_stage):
                # a talker's codec tokens as they come: what a reply cancelled midway generated of its audio (a
                # finished one gets the exact count with the audio stage's output: upstream_tokens, below)
                self.audio_tokens += len(item.token_ids)
            if item.stage == job.usage_stage:
                if item.prompt_text is not None and job.echo and self.prompt_text is None:
                    self.prompt_text, self.prompt_token_texts = item.prompt_text, item.prompt_token_texts
                    self.prompt_logprobs = item.prompt_logprobs
                    out.append(TextEvent(item.prompt_text, echo=True))
                self.prompt_tokens = item.num_prompt_tokens or self.prompt_tokens
                if item.num_cached_tokens is not None and self.cached_tokens is None:  # (the first delta's)
                    self.cached_tokens = item.num_cached_tokens
                    self.prompt_mm_tokens = dict(item.prompt_mm_tokens or {})
                    self.cached_mm_tokens = dict(item.cached_mm_tokens or {})
                self.completion_tokens += len(item.token_ids)
                if item.logprobs is not None:
                    if self.logprobs is None:
                        self.logprobs = []
                    self.logprobs.extend(item.logprobs)
                out += self._text(self._stop.feed(item.text), item.logprobs)
                if self._stop.stopped:
                    self.finish_reason = "stop"
            audio = getattr(item, "audio", None)  # stages that stream their waveform (codec chunks)
            if audio is not None and item.stage == job.audio_stage:
                out += self._audio(np.asarray(audio, dtype=np.float32).reshape(-1),
                                   getattr(item, "sampling_rate", None))
            return out
        if item.error is not None:
            if (item.error.code == REPLY_TOO_SHORT_TO_VOICE and job.audio_stage is not None
                    and job.voice_after is None and not self._voice_whole):
                # The thinker's reply ended after one token (eos first, a stop string in it, a grammar): the talker
                # cannot voice it as it comes. Its text is whole: voiced by a second pass (as voice_short_replies),
                # or no audio at all for an empty one.
                self._voice_whole = True
                self._done |= self._wanted
                self.finish_reason = self.finish_reason or "stop"
                return out + self._text(self._stop.flush())
            raise self._error(item.error)
        self._done.add(item.stage)
        if item.stage == job.usage_stage:
            if job.echo and self.prompt_text is None and item.prompt_text is not None:
                out.append(TextEvent(item.prompt_text, echo=True))  # it sent no delta with a token
            out += self._text(self._stop.flush())
            self.finish_reason = self.finish_reason or item.finish_reason or "stop"
            self.stop_reason = item.stop_reason  # vLLM's: the stop string or stop token id that ended the text
            self.prompt_tokens = len(item.prompt_token_ids)
            self.completion_tokens = len(item.token_ids)
            self.cached_tokens = item.num_cached_tokens
            self.prompt_mm_tokens, self.cached_mm_tokens = item.prompt_mm_tokens, item.cached_mm_tokens
            if item.logprobs is not None:
                self.logprobs = item.logprobs  # all of them (deltas carried them too, when it streamed)
            self.prompt_logprobs = item.prompt_logprobs
            self.prompt_text, self.prompt_token_texts = item.prompt_text, item.prompt_token_texts
        if item.stage == job.audio_stage:
            # what the stages feeding the audio stage generated (the text stage's own reply is text, not audio)
            self.audio_tokens = sum(n for stage, n in item.upstream_tokens.items() if stage != job.usage_stage)
        if item.stage == job.audio_stage and item.audio is not None:
            full = np.asarray(item.audio, dtype=np.float32).reshape(-1)
            out += self._audio(full[self._audio_sent:], item.passthrough.get("sampling_rate"))
        return out

    def _heard(self, item: StageDelta | StageOutput) -> list[HeardEvent]:
        if isinstance(item, StageDelta):
            self._heard_text += item.text or ""
            return [HeardEvent(item.text)] if item.text else []
        if item.error is not None:
            raise self._error(item.error)
        self._done.add(item.stage)
        self.heard = StageUsage(len(item.prompt_token_ids), len(item.token_ids), dict(item.prompt_mm_tokens or {}))
        whole = item.text or ""  # what its deltas did not carry (none when it streamed them all)
        rest = whole[len(self._heard_text):] if whole.startswith(self._heard_text) else ""
        return [HeardEvent(rest), HeardEvent("", done=True)] if rest else [HeardEvent("", done=True)]

    def _text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[TextEvent]:
        self.text += text
        if self.job.text_stage is None or self.job.echo_only:  # echo_only: the token sampled is not sent
            return []
        return [TextEvent(text, logprobs)]

    def _audio(self, samples: np.ndarray, rate: Any) -> list[AudioEvent]:
        if samples.size == 0:
            return []
        if not self._audio_seen:
            self._audio_seen = True
            if self.observer is not None:
                self.observer.first_audio(time.monotonic() - self.t0)
        self._audio_sent += samples.size
        return [AudioEvent(samples, int(rate or self.default_rate))]


async def leave_runs(tasks: list[asyncio.Task], runs: list[Run]) -> None:
    """Leave a request's runs (n choices, a clip's segments): their tasks cancelled and awaited, each run left
    (aborted on every stage where it still runs). Shielded, as Run.aclose: it also runs inside a cancelled scope
    (a client that went away)."""
    with anyio.CancelScope(shield=True):
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        for r in runs:
            await r.aclose()


def summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Token counts by kind ({"audio": n, "image": m}) added up over runs."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out
