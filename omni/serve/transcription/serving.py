"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`: OpenAI's speech-to-text endpoints on a
pipeline whose text stage hears audio (the omni thinkers) or whose entry stage is a speech recognizer (Qwen3-ASR:
StageInfo.transcribes_audio), as `client.audio.transcriptions.create(model=..., file=...)` calls them.

    multipart/form-data   file (the clip: WAV, FLAC, OGG, ...; mono or mixed down, resampled to the model's
                          rate), model (the served name), language (ISO-639-1; transcriptions), prompt,
                          response_format (json | text | verbose_json | srt | vtt), temperature (0-1; 0: greedy),
                          stream (transcriptions), include[] (logprobs), timestamp_granularities[] (segment),
                          chunking_strategy ("auto" or {"type": "server_vad", threshold, prefix_padding_ms,
                          silence_duration_ms})
      -> the text stage transcribes the clip (or translates it into English) in a text-only request
         (generation/asr_job.py); a speech recognizer gets the clip, `prompt` as its context and `language` as
         its own, and its reply's language tag is taken off (generation/transcript.py; verbose_json's `language`
         is the one it heard when the request names none); it does not translate
      -> {"text", "usage"} (json; with include logprobs: "logprobs") or the bare text (text); streamed:
         `transcript.text.delta` events, then `transcript.text.done` with the text and the usage

Timestamps (verbose_json's segments, srt, vtt) and `chunking_strategy` cut the clip into speech segments by
voice activity (speech_segments.py: Silero VAD) and transcribe each one as a request of its own (segmented_run.py:
batched by the text stage); the text is the segments' texts joined by spaces, streamed segment by segment.

Refused naming the field: a pipeline without a text stage (`model`), a clip that does not decode (`file`),
word timestamps (the model gives none), logprobs with a format other than json, streaming a timestamped format,
diarization options, and unknown fields.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from omni.serve.audio.codecs import decode_audio
from omni.serve.audio.vad import VadUnavailable, speech_probabilities
from omni.serve.generation.asr_job import asr_job, asr_usage
from omni.serve.generation.openai_shapes import token_entry
from omni.serve.generation.transcript import Transcript
from omni.serve.generation.run import Run, TextEvent
from omni.serve.http.disconnect import ClientGone, race
from omni.serve.http.errors import ApiError, bad_request, from_validation_error
from omni.serve.http.sse import sse_error, sse_event, sse_response
from omni.serve.protocol.transcription import ServerVad, TranscriptionForm, TranscriptionFormBase, TranslationForm
from omni.serve.state import ServerState, check_model
from omni.serve.transcription.formats import joined_text, to_srt, to_verbose_json, to_vtt
from omni.serve.transcription.segmented_run import SegmentedRun
from omni.serve.transcription.speech_segments import VadOptions, speech_segments

TIMESTAMPED = ("srt", "vtt", "verbose_json")
MAX_FIELD_BYTES = 64 * 1024  # a form field that is not the file (the prompt is the longest)
_NESTED = re.compile(r"^(\w+)\[(\w+)\]$")  # `chunking_strategy[type]`: how OpenAI's clients send an object


async def _read_form(request: Request, model: type[TranscriptionFormBase], max_bytes: int
                     ) -> tuple[TranscriptionFormBase, bytes]:
    """The form's fields (validated, arrays from `name[]` keys) and the file's bytes; 400 naming the field."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(415, "send multipart/form-data (a `file` and the fields), as OpenAI's clients do",
                       code="unsupported_media_type")
    try:
        form = await request.form(max_files=1, max_fields=64, max_part_size=MAX_FIELD_BYTES)
    except Exception as e:  # noqa: BLE001 - a malformed body is the client's: say what the parser said
        raise bad_request(f"the multipart body could not be read: {e}") from None
    try:
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise bad_request("file: the audio file is required (a multipart file part)", "file",
                              "missing_required_parameter")
        data = await upload.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ApiError(413, f"file: more than {max_bytes} bytes (--max-media-mb)", param="file",
                           code="file_too_large")
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key == "file":
                continue
            if not isinstance(value, str):
                raise bad_request(f"{key}: one file only, in `file`", key)
            nested = _NESTED.match(key)
            if key.endswith("[]"):
                fields.setdefault(key[:-2], []).append(value)
            elif nested:
                fields.setdefault(nested[1], {})[nested[2]] = value
            elif key == "chunking_strategy" and value.lstrip().startswith("{"):
                fields[key] = _json_field(key, value)
            else:
                fields[key] = value
    finally:
        await form.close()
    try:
        req = model.model_validate(fields)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if isinstance(req, TranscriptionForm):
        _check_options(req)
    return req, data


def _json_field(key: str, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as e:
        raise bad_request(f"{key}: not valid JSON ({e})", key) from None


def _check_options(req: TranscriptionForm) -> None:
    """The combinations OpenAI allows, and what omni cannot give, refused naming the field."""
    granularities = req.timestamp_granularities or []
    if "word" in granularities:
        raise bad_request("timestamp_granularities: word timestamps are not produced (the model gives none); "
                          "segment", "timestamp_granularities", "unsupported_value")
    if granularities and req.response_format != "verbose_json":
        raise bad_request(f"timestamp_granularities: needs response_format verbose_json, not {req.response_format}",
                          "timestamp_granularities")
    if req.include and req.response_format != "json":
        raise bad_request(f"include: logprobs come with response_format json, not {req.response_format}", "include")
    if req.stream and req.response_format in TIMESTAMPED:
        raise bad_request(f"stream: response_format {req.response_format} is not streamed; json or text",
                          "stream")


async def create_transcription(state: ServerState, request: Request) -> Response:
    return await _serve(state, request, "transcribe")


async def create_translation(state: ServerState, request: Request) -> Response:
    return await _serve(state, request, "translate")


async def _serve(state: ServerState, request: Request, task: str) -> Response:
    settings = state.settings
    req, data = await _read_form(request, TranscriptionForm if task == "transcribe" else TranslationForm,
                                 settings.max_media_bytes)
    check_model(req.model, state.info)
    if state.info.text_stage is None:
        raise bad_request(f"model: pipeline {state.info.model!r} has no text output stage", "model")
    wave, rate = decode_audio(data, "file", settings.max_media_bytes, settings.audio_input_rate)
    chunking = getattr(req, "chunking_strategy", None)
    if req.response_format in TIMESTAMPED or chunking is not None:
        return await _serve_segments(state, request, req, task, wave, rate, chunking)
    language = getattr(req, "language", None)
    job = asr_job(state.info, wave, rate, task=task, language=language, prompt=req.prompt,
                  temperature=req.temperature, fields=_fields(state.info), logprobs=_wants_logprobs(req))
    state.admit()
    run = Run(state.omni, job, settings.default_audio_rate, state.metrics)

    async def reply() -> Response:
        text = await _text(run, state.info.transcript_marker)
        if req.response_format == "text":
            return PlainTextResponse(text)
        body: dict[str, Any] = {"text": text, "usage": asr_usage(run)}
        if _wants_logprobs(req):
            body["logprobs"] = _logprobs(run.logprobs or [])
        return JSONResponse(body)

    return await _answer(state, request, run, getattr(req, "stream", False),
                         lambda: _events(state, run, _wants_logprobs(req)), reply)


async def _answer(state: ServerState, request: Request, run: Run | SegmentedRun, stream: bool,
                  events: Callable[[], AsyncIterator[dict[str, str]]], reply: Callable[[], Awaitable[Response]]
                  ) -> Response:
    """Start the run, then hand it to the SSE stream (which releases it) or await the reply; a client that went
    away, a refusal or the end of the reply leaves the run (aborted where it still runs) and releases it."""
    reason = "abort"
    handed_over = False
    try:
        await race(request, run.start(), state.drain.stopping)
        if stream:
            handed_over = True
            return sse_response(events())
        response = await race(request, reply(), state.drain.stopping)
        reason = run.finish_reason or "stop"
        return response
    except ClientGone:
        return Response(status_code=499)
    except ApiError:
        reason = "error"
        raise
    finally:
        if not handed_over:
            await run.aclose()
            state.release(run, reason)


# omni's names -> the request's: a thinker's prompt is the clip (the instruction is the server's); a speech
# recognizer's prompt is the request's context, its audio the clip, its processor's language the request's
FIELDS = {"prompt": "file", "temperature": "temperature"}
RECOGNIZER_FIELDS = {"prompt": "prompt", "multi_modal_data": "file", "mm_processor_kwargs": "language",
                     "temperature": "temperature"}


def _fields(info: Any) -> dict[str, str]:
    return RECOGNIZER_FIELDS if info.transcribes_audio else FIELDS


def _wants_logprobs(req: TranscriptionFormBase) -> bool:
    return "logprobs" in (getattr(req, "include", None) or [])


def _logprobs(lps: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's transcription logprobs: each reply token's text, log-probability and bytes (the token's own)."""
    return [token_entry(lp.token, lp.logprob, lp.token_bytes) for lp in lps]


async def _serve_segments(state: ServerState, request: Request, req: TranscriptionFormBase, task: str, wave: np.ndarray,
                          rate: int, chunking: Any) -> Response:
    """The clip cut at its silences, each speech segment transcribed on its own (module docstring)."""
    settings = state.settings
    opts = VadOptions() if not isinstance(chunking, ServerVad) else VadOptions(
        chunking.threshold, chunking.prefix_padding_ms, chunking.silence_duration_ms)
    try:  # Silero over the clip: ~0.5 ms a 32 ms frame, off the event loop
        probs = await asyncio.to_thread(speech_probabilities, wave, rate)
    except VadUnavailable as e:
        param = "chunking_strategy" if chunking is not None else "response_format"
        raise ApiError(501, f"{param}: {e}", param=param, code="unsupported_value") from None
    duration = len(wave) / rate
    spans = speech_segments(probs, duration, opts)
    language = getattr(req, "language", None)
    logprobs = _wants_logprobs(req)
    jobs = [asr_job(state.info, wave[int(s.start_s * rate):int(s.end_s * rate)], rate, task=task, language=language,
                    prompt=req.prompt, temperature=req.temperature, fields=_fields(state.info),
                    logprobs=logprobs or req.response_format == "verbose_json") for s in spans]
    state.admit()
    runs = SegmentedRun(state.omni, jobs, spans, settings.default_audio_rate, state.info.transcript_marker)

    async def reply() -> Response:
        segments = await _collect(runs)
        fmt = req.response_format
        if fmt == "srt" or fmt == "vtt":
            return PlainTextResponse((to_srt if fmt == "srt" else to_vtt)(segments),
                                     media_type="application/x-subrip" if fmt == "srt" else "text/vtt")
        if fmt == "verbose_json":
            heard = next((s.language for s in segments if s.language), None)
            return JSONResponse(to_verbose_json(segments, task=task, language=language or heard, duration_s=duration,
                                                temperature=req.temperature, usage=asr_usage(runs)))
        text = joined_text(segments)
        if fmt == "text":
            return PlainTextResponse(text)
        body: dict[str, Any] = {"text": text, "usage": asr_usage(runs)}
        if logprobs:
            body["logprobs"] = [lp for seg in segments for lp in _logprobs(seg.token_logprobs)]
        return JSONResponse(body)

    return await _answer(state, request, runs, getattr(req, "stream", False),
                         lambda: _segment_events(state, runs, logprobs), reply)


async def _collect(runs: SegmentedRun) -> list[Any]:
    return [seg async for seg in runs.segments()]


async def _text(run: Run, marker: str | None) -> str:
    transcript = Transcript(marker)
    async for ev in run.events():
        if isinstance(ev, TextEvent):
            transcript.feed(ev.text)
    transcript.finish()
    return transcript.text


def _delta(text: str, lps: list[Any] | None) -> dict[str, str]:
    body: dict[str, Any] = {"type": "transcript.text.delta", "delta": text}
    if lps is not None:
        body["logprobs"] = _logprobs(lps)
    return sse_event(body)


def _done_event(text: str, run: Any, lps: list[Any] | None) -> dict[str, str]:
    body: dict[str, Any] = {"type": "transcript.text.done", "text": text, "usage": asr_usage(run)}
    if lps is not None:
        body["logprobs"] = _logprobs(lps)
    return sse_event(body)


async def _run_pieces(run: Run, marker: str | None) -> AsyncIterator[tuple[str, list[Any]]]:
    """The transcript's pieces as the reply streams (a speech recognizer's language tag held back and dropped)."""
    transcript = Transcript(marker)
    async for ev in run.events():
        # a piece with no text may still carry tokens (one whose character the next token completes, an eos)
        if isinstance(ev, TextEvent) and (ev.text or ev.logprobs):
            yield transcript.feed(ev.text), ev.logprobs or []
    if rest := transcript.finish():
        yield rest, []


async def _segment_pieces(runs: SegmentedRun) -> AsyncIterator[tuple[str, list[Any]]]:
    """One piece a segment, in the clip's order, each as soon as it and those before it are transcribed."""
    first = True
    async for seg in runs.segments():
        piece = seg.text.strip()
        if piece:
            yield (piece if first else " " + piece), seg.token_logprobs
            first = False
        else:  # no text, but its tokens still count (their logprobs)
            yield "", seg.token_logprobs


def _events(state: ServerState, run: Run, logprobs: bool) -> AsyncIterator[dict[str, str]]:
    return _transcript_events(state, run, _run_pieces(run, state.info.transcript_marker), logprobs)


def _segment_events(state: ServerState, runs: SegmentedRun, logprobs: bool) -> AsyncIterator[dict[str, str]]:
    return _transcript_events(state, runs, _segment_pieces(runs), logprobs)


async def _transcript_events(state: ServerState, run: Run | SegmentedRun, pieces: AsyncIterator[tuple[str, list[Any]]],
               logprobs: bool) -> AsyncIterator[dict[str, str]]:
    """`transcript.text.delta` a piece, then `.done` with the text (an `error` event once the status line is
    gone); the run is released at the end, however it ends. Every reply token's logprob is streamed once: those
    of tokens with no text of their own yet (part of a character the next token completes) go with the next
    delta, as the text they are part of; any left at the end (an eos) in a last delta with no text."""
    reason, text, lps, waiting = "abort", "", [], []
    try:
        async for piece, piece_lps in pieces:
            lps.extend(piece_lps)
            waiting.extend(piece_lps)
            if piece:
                text += piece
                yield _delta(piece, waiting if logprobs else None)
                waiting = []
        if waiting and logprobs:
            yield _delta("", waiting)
        reason = run.finish_reason or "stop"
        yield _done_event(text, run, lps if logprobs else None)
    except ApiError as e:
        reason = "error"
        yield sse_error(e)  # the status line is gone: an error event, as OpenAI's streams end
    finally:
        await run.aclose()
        state.release(run, reason)
