"""The two generation endpoints: parse, admit, run, reply (JSON or server-sent events).

    body -> pydantic request (400 naming the field) -> model check (404) -> admission (503 past
    runtime.max_pending_requests) -> Job (media decoded off the event loop; 400 / 413) ->
    Choices.start (every choice's Run; 400 when the pipeline refuses it, 504 on timeout) -> reply

A client that disconnects aborts its request on every stage: while it waits for a non-streamed reply
(a watcher on the connection cancels the run), or mid-stream (the SSE response is cancelled). When a
shutdown's grace period runs out (shutdown.py), a waiting request is answered 503 and a stream ends
with an error event and [DONE]; their runs are aborted the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.async_api import AsyncOmni
from omni.serve import responses as R
from omni.serve.audio import pcm16_chunks
from omni.serve.audio_ids import AudioTranscripts
from omni.serve.choices import Choices
from omni.serve.errors import ApiError, bad_request, from_validation_error, internal
from omni.serve.metrics import ServerMetrics
from omni.serve.protocol import PART_TAGS, ChatCompletionRequest, CompletionRequest, TextPart
from omni.serve.reply_stream import AudioEvent, Run, TextEvent
from omni.serve.settings import ServeSettings
from omni.serve.shutdown import Drain, ShuttingDown, shutting_down, until_stopped
from omni.serve.speech_formats import encodable
from omni.serve.tool_parser import ToolCallStream
from omni.serve.tools import reply_tool_calls
from omni.serve.translate import PipelineInfo, chat_job, check_model, completion_jobs

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


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
    audio_transcripts: AudioTranscripts = field(default_factory=lambda: AudioTranscripts(R.AUDIO_TTL_S))

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

    def release(self, run: Run | Choices | None, finish_reason: str, count: int = 1) -> None:
        self.pending -= count
        self.metrics.pending.set(self.pending)
        if run is not None:
            self.metrics.request_done(finish_reason, time.monotonic() - run.t0, run.prompt_tokens,
                                      run.completion_tokens, run.cached_tokens)


def parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e, PART_TAGS) from None


async def race(request: Request, work: Awaitable[T], stopping: asyncio.Event | None = None) -> T:
    """Await `work`, cancelled if the client disconnects first (ClientGone) or `stopping` is set first
    (503 `shutting_down`: the shutdown's grace period ran out)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watchers = {asyncio.ensure_future(disconnected())}
    if stopping is not None:
        watchers.add(asyncio.ensure_future(stopping.wait()))
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this handler was cancelled (a proxy that saw the client go)
        task.cancel()
        raise
    finally:
        for w in watchers:
            w.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if stopping is not None and stopping.is_set():
            raise shutting_down("its grace period ran out before this reply was complete")
        raise ClientGone
    return task.result()


def _sse(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, separators=(",", ":"))}


async def _serve(state: ServerState, request: Request, req: ChatCompletionRequest | CompletionRequest,
                 run_for: Any, reply: Any, stream: Any) -> Response:
    """Admission (one slot per choice of every prompt), the run, the reply; `run_for() -> Choices` builds the run
    (off the loop), `reply(run) -> Response` collects a non-streamed one, `stream(run) -> async iterator of SSE
    events` streams."""
    prompts = len(req.prompts) if isinstance(req, CompletionRequest) else 1
    count = prompts * req.choices
    if prompts > 1:
        state.admit(count, f"{prompts} prompts x {req.choices} choices", "prompt")
    else:
        state.admit(count)
    run: Choices | None = None
    handed_over = False
    reason = "error"
    try:
        run = await asyncio.to_thread(run_for)
        stopping = state.drain.stopping
        if not req.stream:
            response = await race(request, reply(run), stopping)
            reason = run.finish_reason or "stop"
            return response
        await race(request, run.start(), stopping)
        handed_over = True  # the stream releases the admission when it ends
        return _Stream(state, run, stream(run))
    except ClientGone:
        reason = "abort"
        return Response(status_code=499)
    finally:
        if not handed_over:
            if run is not None:
                await run.aclose()
            state.release(run, reason, count)


class _Stream(EventSourceResponse):
    """The SSE reply of one run: a failure midway is an error event (the status line is long gone), then
    [DONE]; so is the end of a shutdown's grace period (`shutting_down`). However the response ends (done, a disconnect, a body that never started because the client
    was gone already), the run is left (aborted where it still runs) and the admission released, once."""

    def __init__(self, state: ServerState, run: Choices, events: AsyncIterator[dict[str, Any]]):
        self._omni_state, self._run, self._finished = state, run, False
        super().__init__(self._body(events), sep="\n", ping=15)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close("abort")

    async def _close(self, reason: str) -> None:
        if not self._finished:
            self._finished = True
            await self._run.aclose()
            self._omni_state.release(self._run, reason, len(self._run.runs))

    async def _body(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        run, reason = self._run, "abort"
        try:
            async with contextlib.aclosing(events) as evs, \
                    contextlib.aclosing(until_stopped(evs, self._omni_state.drain.stopping)) as items:
                async for ev in items:
                    yield _sse(ev)
            reason = run.finish_reason or "stop"
        except ShuttingDown:
            reason = "error"
            yield _sse(shutting_down("its grace period ran out before this stream was complete").body())
        except ApiError as e:
            reason = "error"
            yield _sse(e.body())
        except Exception as e:  # noqa: BLE001 - a bug must still end the stream properly
            logger.exception("request %s failed while streaming", run.job.request_id)
            reason = "error"
            yield _sse(internal(f"the server failed while streaming: {type(e).__name__}").body())
        finally:
            await self._close(reason)
        yield {"data": "[DONE]"}


# ----------------------------------------------------------------- chat
def _earlier_audio_replies(req: ChatCompletionRequest, transcripts: AudioTranscripts) -> None:
    """An assistant message that names an earlier spoken reply by audio id only (OpenAI's multi-turn voice
    pattern) gets that reply's transcript as its content (audio_ids.py); an id not kept here is a 400 naming it."""
    for i, msg in enumerate(req.messages):
        if msg.content is None and msg.audio is not None:
            text = transcripts.get(msg.audio.id)
            if text is None:
                raise bad_request(f"messages[{i}].audio.id: {msg.audio.id!r} is not a spoken reply this server still "
                                  f"keeps (they expire {R.AUDIO_TTL_S} s after the reply; only this server's "
                                  "own); send the reply's transcript as the message's content",
                                  f"messages[{i}].audio.id", "invalid_value")
            msg.content = [TextPart(type="text", text=text)]


async def chat_completions(state: ServerState, request: Request) -> Response:
    req = parse(ChatCompletionRequest, await request.body())
    check_model(req.model, state.info)
    rid, created, model = R.new_id("chatcmpl", req.request_id), int(time.time()), state.info.model
    _earlier_audio_replies(req, state.audio_transcripts)
    fmt = req.audio.format if req.audio is not None else "wav"
    if fmt != "pcm16" and fmt not in encodable():
        raise bad_request(f"audio.format: {fmt!r} has no encoder on this server; one of "
                          f"{', '.join(f for f in encodable() if f != 'pcm')}, pcm16", "audio.format",
                          "unsupported_value")

    def run_for() -> Choices:
        return Choices(state.omni, chat_job(req, state.info, state.settings, rid), req.choices,
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
                for pcm in pcm16_chunks(ev.samples, per_chunk):
                    delta, modality = R.audio_delta(audio_ids[index], pcm, vllm)
                    yield chunk(delta, modality=modality, index=index)
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
                state.audio_transcripts.put(audio_ids[index], r.text, int(time.time()) + R.AUDIO_TTL_S)
        if req.include_usage:
            yield chunk(None, usage_=R.usage(run))

    return await _serve(state, request, req, run_for, reply, stream)


# ----------------------------------------------------------- completions
async def completions(state: ServerState, request: Request) -> Response:
    req = parse(CompletionRequest, await request.body())
    check_model(req.model, state.info)
    rid, created, model = R.new_id("cmpl", req.request_id), int(time.time()), state.info.model

    def run_for() -> Choices:
        return Choices(state.omni, completion_jobs(req, state.info, rid), req.choices,
                       state.settings.default_audio_rate, state.metrics)

    async def reply(run: Choices) -> Response:
        await run.start()
        async with contextlib.aclosing(run.events()) as evs:
            async for _ in evs:
                pass
        return JSONResponse(R.completion(rid, model, created, run))

    async def stream(run: Choices) -> AsyncIterator[dict[str, Any]]:
        offsets = [0] * len(run.runs)  # text_offset of each choice's next token, over its whole completion
        live = req.continuous_usage  # vLLM's continuous_usage_stats: every chunk with the usage so far

        def chunk(text: str | None, **kw: Any) -> dict[str, Any]:
            if live and "usage_" not in kw:
                kw["usage_"] = R.completion_usage(run)
            return R.completion_chunk(rid, model, created, text, **kw)

        async with contextlib.aclosing(run.events()) as evs:
            async for index, ev in evs:
                if isinstance(ev, TextEvent) and ev.echo:
                    logprobs = R.echo_logprobs(run.runs[index]) if run.runs[index].job.echo_logprobs else None
                    yield chunk(ev.text, index=index, logprobs=logprobs)
                    offsets[index] += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
                elif isinstance(ev, TextEvent) and (ev.text or ev.logprobs):
                    yield chunk(ev.text, index=index, logprobs=R.completion_logprobs(ev.logprobs, offsets[index]))
                    offsets[index] += sum(len(e.token or "") for e in ev.logprobs or ())
        for index, r in enumerate(run.runs):
            yield chunk("", finish_reason=r.finish_reason, index=index, stop_reason=r.stop_reason)
        if req.include_usage:
            yield chunk(None, usage_=R.completion_usage(run))

    return await _serve(state, request, req, run_for, reply, stream)
