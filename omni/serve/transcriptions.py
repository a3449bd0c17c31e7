"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`: OpenAI's speech-to-text endpoints on a
pipeline whose text stage hears audio (the omni thinkers), as `client.audio.transcriptions.create(model=...,
file=...)` calls them.

    multipart/form-data   file (the clip: WAV, FLAC, OGG, ...; mono or mixed down, resampled to the model's
                          rate), model (the served name), language (ISO-639-1; transcriptions), prompt,
                          response_format (json | text), temperature (0-1; 0: greedy), stream (transcriptions)
      -> the text stage transcribes the clip (or translates it into English) in a text-only request (asr.py)
      -> {"text", "usage"} (json) or the bare text (text); streamed: `transcript.text.delta` events, then
         `transcript.text.done` with the text and the usage

Refused naming the field: a pipeline without a text stage (`model`), a clip that does not decode (`file`),
formats that need timestamps this server does not have (srt, vtt, verbose_json; `timestamp_granularities`),
`include` (logprobs), diarization and chunking options, and unknown fields.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from omni.serve.asr import asr_job, asr_usage
from omni.serve.audio import decode_audio
from omni.serve.endpoints import ClientGone, ServerState, race
from omni.serve.errors import ApiError, bad_request, from_validation_error
from omni.serve.reply_stream import Run, TextEvent
from omni.serve.translate import check_model

NO_TIMESTAMPS = ("srt", "vtt", "verbose_json")
MAX_FIELD_BYTES = 64 * 1024  # a form field that is not the file (the prompt is the longest)


class _Form(BaseModel):
    # lax: a form's values are strings ("0.2", "true"); unknown fields are refused by name
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model name.")
    prompt: str | None = Field(None, max_length=4000, description="Text that guides the transcription.")
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = Field("json")
    temperature: float = Field(0.0, ge=0.0, le=1.0, description="0: greedy.")


class TranscriptionForm(_Form):
    language: str | None = Field(None, pattern=r"^[a-z]{2,3}$", description="ISO-639-1 code of the speech.")
    stream: bool = False
    # OpenAI's options this server does not implement: accepted absent only
    timestamp_granularities: list[str] | None = None
    include: list[str] | None = None
    chunking_strategy: Any = None
    known_speaker_names: list[str] | None = None
    known_speaker_references: list[str] | None = None


class TranslationForm(_Form):
    pass


async def _read_form(request: Request, model: type[_Form], max_bytes: int) -> tuple[_Form, bytes]:
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
            if key.endswith("[]"):
                fields.setdefault(key[:-2], []).append(value)
            else:
                fields[key] = value
    finally:
        await form.close()
    try:
        req = model.model_validate(fields)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if req.response_format in NO_TIMESTAMPS:
        raise bad_request(f"response_format: {req.response_format} needs timestamps, which this server does not "
                          "produce; json or text", "response_format", "unsupported_value")
    if isinstance(req, TranscriptionForm):
        for name in ("timestamp_granularities", "include", "chunking_strategy", "known_speaker_names",
                     "known_speaker_references"):
            if getattr(req, name) is not None:
                raise bad_request(f"{name}: not implemented by this server; send it absent", name,
                                  "unsupported_parameter")
    return req, data


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
    language = getattr(req, "language", None)
    job = asr_job(state.info, wave, rate, task=task, language=language, prompt=req.prompt,
                  temperature=req.temperature, fields={"prompt": "file", "temperature": "temperature"})
    state.admit()
    run = Run(state.omni, job, settings.default_audio_rate, state.metrics)
    reason = "abort"
    handed_over = False
    try:
        await race(request, run.start(), state.drain.stopping)
        if getattr(req, "stream", False):
            handed_over = True
            return EventSourceResponse(_events(state, run), sep="\n", ping=15)
        text = await race(request, _text(run), state.drain.stopping)
        reason = run.finish_reason or "stop"
        if req.response_format == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text, "usage": asr_usage(run)})
    except ClientGone:
        return Response(status_code=499)
    except ApiError:
        reason = "error"
        raise
    finally:
        if not handed_over:
            await run.aclose()
            state.release(run, reason)


async def _text(run: Run) -> str:
    text = ""
    async for ev in run.events():
        if isinstance(ev, TextEvent):
            text += ev.text
    return text


async def _events(state: ServerState, run: Run) -> AsyncIterator[dict[str, str]]:
    reason, text = "abort", ""
    try:
        async for ev in run.events():
            if isinstance(ev, TextEvent) and ev.text:
                text += ev.text
                yield {"data": json.dumps({"type": "transcript.text.delta", "delta": ev.text})}
        reason = run.finish_reason or "stop"
        yield {"data": json.dumps({"type": "transcript.text.done", "text": text, "usage": asr_usage(run)})}
    except ApiError as e:  # the status line is gone: an error event, as OpenAI's streams end
        reason = "error"
        yield {"data": json.dumps({"type": "error", "error": {"type": e.type, "code": e.code, "message": e.message,
                                                              "param": e.param}})}
    finally:
        await run.aclose()
        state.release(run, reason)
