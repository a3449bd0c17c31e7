"""`POST /v1/chat/completions`: text, images and audio in; text and audio out, JSON or server-sent events
(chat/replies.py admits, runs and answers; this module says what the reply holds)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.serve.audio.codecs import sample_chunks, to_pcm16
from omni.serve.audio.formats import encodable
from omni.serve.chat import shapes as R
from omni.serve.chat.choices import Choices
from omni.serve.chat.jobs import chat_job
from omni.serve.chat.replies import serve_choices
from omni.serve.generation.run import AudioEvent, TextEvent
from omni.serve.generation.tool_parser import ToolCallStream
from omni.serve.generation.tools import reply_tool_calls
from omni.serve.http.errors import bad_request
from omni.serve.protocol.chat import ChatCompletionRequest, TextPart
from omni.serve.protocol.parse import parse_request
from omni.serve.state import AUDIO_TTL_S, AudioTranscripts, ServerState, check_model


def earlier_audio_replies(req: ChatCompletionRequest, transcripts: AudioTranscripts) -> None:
    """An assistant message that names an earlier spoken reply by audio id only (OpenAI's multi-turn voice
    pattern) gets that reply's transcript as its content (state.py); an id not kept here is a 400 naming it."""
    for i, msg in enumerate(req.messages):
        if msg.content is None and msg.audio is not None:
            text = transcripts.get(msg.audio.id)
            if text is None:
                raise bad_request(f"messages[{i}].audio.id: {msg.audio.id!r} is not a spoken reply this server still "
                                  f"keeps (they expire {AUDIO_TTL_S} s after the reply; only this server's "
                                  "own); send the reply's transcript as the message's content",
                                  f"messages[{i}].audio.id", "invalid_value")
            msg.content = [TextPart(type="text", text=text)]


async def chat_completions(state: ServerState, request: Request) -> Response:
    default = [m for m in state.settings.default_modalities if m != "audio" or state.info.audio_stage is not None]
    req = parse_request(ChatCompletionRequest, await request.body(), {"default_modalities": default})
    check_model(req.model, state.info)
    rid, created, model = R.new_id("chatcmpl", req.request_id), int(time.time()), state.info.model
    earlier_audio_replies(req, state.audio_transcripts)
    fmt = req.audio.format if req.audio is not None else "wav"
    if fmt != "pcm16" and fmt not in encodable():
        raise bad_request(f"audio.format: {fmt!r} has no encoder on this server; one of "
                          f"{', '.join(f for f in encodable() if f != 'pcm')}, pcm16", "audio.format",
                          "unsupported_value")

    def run_for() -> Choices:
        return Choices(state.omni, chat_job(req, state.info, state.settings, rid, state.uploaded_voices), req.choices,
                       state.settings.default_audio_rate, state.metrics)

    async def reply(run: Choices) -> Response:
        await run.start()
        audio: list[list[np.ndarray]] = [[] for _ in run.runs]
        rates = [state.settings.default_audio_rate] * len(run.runs)
        async with contextlib.aclosing(run.events()) as evs:
            async for index, ev in evs:
                if isinstance(ev, AudioEvent):
                    audio[index].append(ev.samples)
                    rates[index] = ev.rate
        audios = [R.audio_message(a, rate, fmt, r.text) if r.job.audio_stage or r.voiced else None
                  for a, rate, r in zip(audio, rates, run.runs)]
        for a in filter(None, audios):  # a later turn may name it by id
            state.audio_transcripts.put(a["id"], a["transcript"], a["expires_at"])
        return JSONResponse(R.chat_completion(rid, model, created, run, audios))

    async def stream(run: Choices) -> AsyncIterator[dict[str, Any]]:
        vllm = req.omni_stream_format == "vllm-omni"
        text_mod = "text" if vllm else None
        audio_ids = [R.new_id("audio") for _ in run.runs]
        # the text is also the audio's transcript (a reply voiced once its text is whole too, unless it may be a call)
        job = run.job
        speaks = (job.audio_stage is not None or (job.voice_after is not None and job.tool_parser is None)) and not vllm
        live = req.continuous_usage  # vLLM's continuous_usage_stats: every chunk with the usage so far

        def chunk(delta: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
            if live and "usage_" not in kw:
                kw["usage_"] = R.usage(run)
            return R.chat_chunk(rid, model, created, delta, **kw)

        for index in range(len(run.runs)):
            yield chunk({"role": "assistant", "content": ""}, modality=text_mod, index=index)
        forced = run.job.forced_tool  # a forced tool call: its JSON is held back and sent as tool_calls at the end
        held: list[list[Any]] = [[] for _ in run.runs]  # of each choice: its logprobs, while held back
        # tool_choice "auto": each choice's text through its parser (content before a call goes out as it comes)
        parsers = [ToolCallStream() for _ in run.runs] if run.job.tool_parser is not None else None
        async with contextlib.aclosing(run.events()) as evs:
            async for index, ev in evs:
                if isinstance(ev, TextEvent):
                    text = ev.text if parsers is None else parsers[index].feed(ev.text)
                    if forced is not None:
                        held[index] += ev.logprobs or []
                    elif text or ev.logprobs:
                        yield chunk(R.text_delta(text, audio_ids[index] if speaks else None), modality=text_mod,
                                    logprobs=R.chat_logprobs(ev.logprobs), index=index)
                    continue
                per_chunk = max(1, round(ev.rate * state.settings.audio_chunk_ms / 1000))
                for piece in sample_chunks(ev.samples, per_chunk):  # vLLM-Omni's: each a file of audio.format
                    yield (chunk(R.vllm_audio_delta(piece, ev.rate, fmt), modality="audio", index=index) if vllm
                           else chunk(R.audio_delta(audio_ids[index], to_pcm16(piece)), index=index))
        for index, r in enumerate(run.runs):
            finish_reason = r.finish_reason
            if forced is not None:
                calls, finish_reason = reply_tool_calls(forced, r.text, r.finish_reason)
                delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls is not None
                         else {"content": r.text})  # not a complete call (cut short): the text
                yield chunk(delta, logprobs=R.chat_logprobs(held[index] or None), index=index)
            elif parsers is not None:
                rest, calls = parsers[index].finish()
                if rest:
                    yield chunk(R.text_delta(rest, None), index=index)
                if calls is not None:
                    yield chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, index=index)
                    finish_reason = "tool_calls"
            yield chunk({}, finish_reason=finish_reason, modality=text_mod, index=index, stop_reason=r.stop_reason)
            if not vllm and (r.job.audio_stage or r.voiced):  # its audio went out by id: a later turn may name it
                state.audio_transcripts.put(audio_ids[index], r.text, int(time.time()) + AUDIO_TTL_S)
        if req.include_usage:
            yield chunk(None, usage_=R.usage(run))

    return await serve_choices(state, request, req, run_for, reply, stream)

