"""`POST /v1/audio/speech`: OpenAI's text-to-speech endpoint on a text -> audio pipeline.

    {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}
      -> the entry stage (the thinker) gets a user turn holding `input` (and `instructions` as its system
         turn) and its reply is *forced* to `input` (sampling `forced_text`: the prompt and the reply are
         prefilled in one pass, nothing is sampled), so the talker and the vocoder voice exactly that text
      -> the audio stage's waveform, encoded as `response_format` (audio/formats.py)

Replies:
    stream_format "audio" (default)  the file's bytes; `pcm` goes out chunk by chunk as the pipeline yields
                                     audio, the other formats once the waveform is complete
    stream_format "sse"              `speech.audio.delta` events (base64 `audio`: pcm16 chunks as they come
                                     for `pcm`, the whole file in one delta otherwise), then `speech.audio.done`
                                     with the usage (input: the thinker's prompt and forced reply
                                     tokens; output: the talker's codec tokens)

Errors before any audio (a bad field, an unknown voice the talker refuses, an encoder this build lacks)
are HTTP errors naming the field: a streamed reply starts only once its first audio exists. `aac` is refused.

`speed` (OpenAI's 0.25-4.0, default 1) changes the tempo of the waveform, not its pitch (audio/time_stretch.py:
WSOLA; resampling would shift the pitch), as the audio comes: a streamed reply stays streamed, and its pieces
are the same samples the file holds.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from omni.errors import ContextLengthError, OmniError
from omni.messages import MultiModalInput, StageInput
from omni.serve.audio.codecs import pcm16_chunks
from omni.serve.audio.formats import MEDIA_TYPES, encodable, encode
from omni.serve.audio.time_stretch import TimeStretch
from omni.serve.generation.job import Job
from omni.serve.generation.openai_shapes import new_id
from omni.serve.generation.run import AudioEvent, Run
from omni.serve.http.disconnect import ClientGone, race
from omni.serve.http.errors import ApiError, bad_request, internal
from omni.serve.http.sse import sse_error, sse_event, sse_response
from omni.serve.protocol.parse import parse_request
from omni.serve.protocol.speech import SpeechRequest
from omni.serve.state import PipelineInfo, ServerState, check_model
from omni.serve.voices.choice import speaks_uploaded, voice_extra
from omni.serve.voices.store import UploadedVoice

logger = logging.getLogger(__name__)


def speech_job(req: SpeechRequest, info: PipelineInfo, request_id: str, uploaded: UploadedVoice | None = None
               ) -> Job:
    """The thinker prompt (instructions, input) with its reply forced to `input`, or, when the entry stage is a
    text-to-speech model, `input` as its prompt with the voice and instructions; audio wanted. On a voice agent the
    LLM's reply is forced (a typed turn: its recognizer hears nothing) and its speech stage voices it. `uploaded`:
    the voice the request names, uploaded to this server (POST /v1/audio/voices): its clip is the request's
    reference (on a voice agent, its speech stage's: voices/choice.py)."""
    if info.audio_stage is None:
        raise bad_request(f"model: pipeline {info.model!r} has no audio output stage", "model")
    if uploaded is not None and info.speaks_prompt:
        extra = {"reference_text": uploaded.text, "instructions": req.instructions or None}
        prompt = StageInput("", prompt=req.input, extra=extra,
                            mm_inputs=[MultiModalInput("audio", uploaded.wave, uploaded.rate)])
        fields = {"prompt": "input", "voice": req.voice_field, "instructions": "instructions"}
        return Job(request_id, prompt, {}, None, info.audio_stage, info.entry_stage, [], fields)
    own = uploaded if speaks_uploaded(info) else None
    if own is None and (unknown := info.unknown_voice(req.speaker, req.voice_field)):
        raise bad_request(unknown, req.voice_field)
    if req.response_format not in encodable():
        raise bad_request(f"response_format: {req.response_format!r} has no encoder on this server; one of "
                          f"{', '.join(encodable())}", "response_format", "unsupported_value")
    if info.speaks_prompt:
        # a text-to-speech model: `input` is its prompt, the voice and the instructions its options
        extra = {"speaker": info.speaker(req.speaker), "instructions": req.instructions or None}
        prompt = StageInput("", prompt=req.input, extra=extra)
        fields = {"prompt": "input", "speaker": req.voice_field, "voice": req.voice_field,
                  "instructions": "instructions"}
        return Job(request_id, prompt, {}, None, info.audio_stage, info.entry_stage, [], fields)
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.append({"role": "user", "content": req.input})
    prompt = StageInput("", prompt=messages, extra=voice_extra(info, req.speaker, own))
    # omni's names -> the request's: the prompt and the forced reply are both `input` (too long a reply
    # is refused as max_tokens would be: it is the input that asks for it)
    fields = {"prompt": "input", "speaker": req.voice_field, "forced_text": "input", "max_tokens": "input"}
    text = info.text_stage or info.entry_stage  # a thinker (the entry stage), or a voice agent's LLM
    return Job(request_id, prompt, {text: {"forced_text": req.input}}, None, info.audio_stage, text, [], fields)


class _SpeechRun(Run):
    """A speech request's run: a context that cannot hold the voiced input is refused in this endpoint's words.
    omni's own ("prompt: N tokens + a forced reply of M tokens ...") speak of a prompt and a forced reply, neither
    of which the caller sent: they sent `input`, which is both the user turn of the prompt and the reply voiced."""

    def _error(self, err: OmniError) -> ApiError:
        if isinstance(err, ContextLengthError) and err.limit is not None and err.actual is not None:
            err = err.replace(message=(
                f"input: too long to voice: the voiced reply needs {err.actual} tokens of the model's context (the "
                f"prompt holding the input, then the input again as the reply spoken), more than the {err.limit} "
                f"it holds (max_model_len of stage {err.stage!r}); shorten input"))
        return super()._error(err)


def _usage(run: Run, speaks_prompt: bool = False) -> dict[str, int]:
    """OpenAI's speech usage: the input is what the thinker read (its prompt, and its reply forced to `input`:
    nothing of it sampled), the output what was generated, the talker's codec tokens (OpenAI's audio tokens). A
    text-to-speech entry stage reads its prompt and generates the audio frames itself."""
    if speaks_prompt:
        return {"input_tokens": run.prompt_tokens, "output_tokens": run.completion_tokens,
                "total_tokens": run.prompt_tokens + run.completion_tokens}
    read = run.prompt_tokens + run.completion_tokens
    return {"input_tokens": read, "output_tokens": run.audio_tokens, "total_tokens": read + run.audio_tokens}


class _Reply:
    """One admitted run: its audio events, and the one place where the run is left and the admission
    released (whether the reply completed, failed, or the client went away)."""

    def __init__(self, state: ServerState, run: Run, speed: float = 1.0):
        self.state, self.run = state, run
        self.speed = speed
        self.events = run.events()
        self.first: AudioEvent | None = None
        self.reason = "abort"
        self._closed = False

    async def first_audio(self) -> None:
        """Pull events until the first audio (errors before it are HTTP errors)."""
        async for ev in self.events:
            if isinstance(ev, AudioEvent):
                self.first = ev
                return
        raise internal("the pipeline finished the request without any audio")

    async def _voiced(self) -> AsyncIterator[AudioEvent]:
        if self.first is not None:
            yield self.first
        async for ev in self.events:
            if isinstance(ev, AudioEvent):
                yield ev
        self.reason = self.run.finish_reason or "stop"

    async def audio(self) -> AsyncIterator[AudioEvent]:
        """The audio as the client gets it: at `speed` (audio/time_stretch.py) when that is not 1."""
        if self.speed == 1.0:
            async for ev in self._voiced():
                yield ev
            return
        stretch: TimeStretch | None = None
        rate = self.state.settings.default_audio_rate
        async for ev in self._voiced():
            if stretch is None:
                stretch, rate = TimeStretch(self.speed, ev.rate), ev.rate
            out = stretch.push(ev.samples)
            if out.size:
                yield AudioEvent(out, rate)
        tail = stretch.finish() if stretch is not None else np.zeros(0, np.float32)
        if tail.size:
            yield AudioEvent(tail, rate)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.events.aclose()
            await self.run.aclose()
            self.state.release(self.run, self.reason)


class _Streamed(Response):
    """A streamed reply (its status and headers are the inner response's): however the response ends
    (done, a disconnect, a body that never started), the reply is closed once."""

    def __init__(self, reply: _Reply, response: Response):
        self.reply, self.response = reply, response
        self.status_code, self.raw_headers, self.background = response.status_code, response.raw_headers, None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.reply.close()


async def create_speech(state: ServerState, request: Request) -> Any:
    req = parse_request(SpeechRequest, await request.body())
    check_model(req.model, state.info)
    job = speech_job(req, state.info, new_id("speech"), state.uploaded_voices.get(req.speaker))
    fmt, media_type = req.response_format, MEDIA_TYPES[req.response_format]
    state.admit()
    run = _SpeechRun(state.omni, job, state.settings.default_audio_rate, state.metrics)
    reply = _Reply(state, run, 1.0 if req.speed is None else req.speed)
    handed_over = False
    try:
        await race(request, _started(run, reply), state.drain.stopping)
        if req.stream_format == "sse":
            response: Response = sse_response(_sse_body(reply, fmt))
        elif fmt == "pcm":
            response = StreamingResponse(_pcm_body(reply), media_type=media_type)
        else:
            samples, rate = await race(request, _collect(reply), state.drain.stopping)
            body = await asyncio.to_thread(encode, samples, rate, fmt)  # mp3 / opus: CPU work off the loop
            reply.reason = run.finish_reason or "stop"
            return Response(body, media_type=media_type)
        handed_over = True
        return _Streamed(reply, response)
    except ClientGone:
        return Response(status_code=499)
    except ApiError:
        reply.reason = "error"
        raise
    finally:
        if not handed_over:
            await reply.close()


async def _started(run: Run, reply: _Reply) -> None:
    await run.start()
    await reply.first_audio()


async def _collect(reply: _Reply) -> tuple[np.ndarray, int]:
    pieces, rate = [], reply.state.settings.default_audio_rate
    async for ev in reply.audio():
        pieces.append(ev.samples)
        rate = ev.rate
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.float32)), rate


def _chunk_samples(state: ServerState, rate: int) -> int:
    return max(1, round(rate * state.settings.audio_chunk_ms / 1000))


async def _pcm_body(reply: _Reply) -> AsyncIterator[bytes]:
    try:
        async for ev in reply.audio():
            for pcm in pcm16_chunks(ev.samples, _chunk_samples(reply.state, ev.rate)):
                yield pcm
    except ApiError:  # the status line is gone: the stream ends short (logged, counted as an error)
        logger.warning("speech %s failed while streaming", reply.run.job.request_id, exc_info=True)
        reply.reason = "error"
    finally:
        await reply.close()


async def _sse_body(reply: _Reply, fmt: str) -> AsyncIterator[dict[str, str]]:
    def delta(data: bytes) -> dict[str, str]:
        return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    try:
        if fmt == "pcm":
            async for ev in reply.audio():
                for pcm in pcm16_chunks(ev.samples, _chunk_samples(reply.state, ev.rate)):
                    yield delta(pcm)
        else:
            samples, rate = await _collect(reply)
            yield delta(await asyncio.to_thread(encode, samples, rate, fmt))
        yield sse_event({"type": "speech.audio.done", "usage": _usage(reply.run, reply.state.info.speaks_prompt)})
    except ApiError as e:
        reply.reason = "error"
        yield sse_error(e)
    finally:
        with contextlib.suppress(Exception):
            await reply.close()

