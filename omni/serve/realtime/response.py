"""One response of a `/v1/realtime` session: the conversation as one pipeline request, its events.

    response.created, response.output_item.added, conversation.item.added, response.content_part.added
    response.output_audio_transcript.delta (or response.output_text.delta)   the text, as it streams
    response.output_audio.delta                                              base64 pcm16 at 24 kHz
    response.output_audio.done, ...transcript.done (or output_text.done), content_part.done,
    response.output_item.done, conversation.item.done, response.done (status, status_details, usage)

With tools (a parser set), the reply's text goes out up to a call's markup and the message item is announced
only once it has content (and is done before the first call's item is added); each call read from the reply
then becomes a function_call item (output_item.added, conversation.item.added, function_call_arguments.delta /
.done, output_item.done, conversation.item.done), and a spoken reply is voiced once its text is whole and holds
no call (reply_stream.Run, Job.voice_after). With a forced tool_choice the reply is constrained to calls and
nothing but their items is sent.

Its task is cancelled for `response.cancel`, a barge-in or a closed socket: the request is aborted on
every stage (Run.aclose), and the assistant item keeps the text that was sent with the audio that was
sent (a text reply keeps what was sent). A response cancelled before its task ever ran still announces
itself and ends (`end`), so every `response.created` has its `response.done`.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from omni.messages import StageInput
from omni.serve.audio import g711
from omni.serve.audio.codecs import pcm16_chunks
from omni.serve.audio.resampling import Resampler8k24k, resample
from omni.serve.audio.time_stretch import TimeStretch
from omni.serve.generation.job import Job, voice_short_replies
from omni.serve.generation.openai_shapes import input_token_details
from omni.serve.generation.run import AudioEvent, HeardEvent, Run, TextEvent
from omni.serve.generation.tool_parser import ToolCallStream
from omni.serve.generation.tools import force_call, reply_tool_calls
from omni.serve.http.errors import ApiError
from omni.serve.realtime import cascade, limits
from omni.serve.realtime.hub import ClientGone
from omni.serve.realtime.conversation import ConvItem, Part, new_item_id
from omni.serve.voices.choice import uploaded_for_cascade, voice_extra

logger = logging.getLogger(__name__)
if TYPE_CHECKING:
    from omni.serve.realtime.session import Session

RATE = 24000  # the protocol's pcm16 rate


def format_shape(fmt: str) -> dict[str, Any]:
    """A session's / response's audio format as the protocol shows it."""
    return {"type": "audio/pcm", "rate": RATE} if fmt == "audio/pcm" else {"type": fmt}


class RealtimeResponse:
    def __init__(self, session: Session, rid: str, item: ConvItem, modality: str, voice: str | None,
                 max_output_tokens: int | str):
        self.session, self.id, self.item, self.modality = session, rid, item, modality
        self.voice, self.max_output_tokens = voice, max_output_tokens
        self.speed = 1.0  # the audio's tempo (audio/time_stretch.py: the pitch kept)
        self.audio_format = "audio/pcm"  # or G.711 at 8 kHz (audio/g711.py)
        self.task: asyncio.Task | None = None
        self.started = False  # its task ran (a task cancelled before its first step runs no code at all)
        self.cancel_reason: str | None = None
        self.t_turn: float | None = None  # commit / speech stop of the turn it answers
        self.in_flight = False  # counted in the server's drain (http/shutdown.py) and admission until it ends
        self.ids = {"response_id": rid, "item_id": item.id, "output_index": 0, "content_index": 0}
        # out of band (response.conversation "none"): its item stays out of the conversation, which it may
        # still read (`context`: the conversation, or the response's own `input` items)
        self.in_conversation = True
        self.context = session.conversation
        self.metadata: dict[str, str] | None = None
        # Functions the model may call (chat-template shape); with a parser, the reply is read for calls: its
        # text streams up to a call's markup, the message item is announced once it has content, each call
        # becomes a function_call item, and a spoken reply is voiced once its text is known to be no call
        self.tools: list[dict[str, Any]] = []
        self.tool_parser: str | None = None
        # tool_choice "required" or a function's name: the reply is constrained to a call (tools.call_schema) and
        # comes as function_call items only, unspoken; a reply cut short by max_output_tokens is shown as text
        self.forced_tool: str | None = None
        self.event_id: str | None = None  # the response.create's (None: a server VAD turn's)
        self.instructions: str | None = None  # those its job was made with (a truncated context's job too)
        self.limit_field = "session.max_output_tokens"  # where its max_output_tokens came from
        self.opened = False  # the message item announced (output_item.added ... content_part.added)
        self.message_done = False  # ... and its done events sent (before a call's item, when the reply calls)
        self.calls: list[ConvItem] = []

    def job(self, instructions: str | None) -> Job:
        """The whole conversation as one request (realtime/conversation.py), this response's options."""
        self.instructions = instructions
        info = self.session.server.info
        messages, media = self.context.prompt(instructions, cascade=info.recognizer is not None)
        extra = voice_extra(info, self.voice, uploaded_for_cascade(info, self.session.server.state.uploaded_voices,
                                                                  self.voice))
        prompt = StageInput("", prompt=messages, mm_inputs=media, extra=extra, tools=self.tools or None)
        text_stage = info.text_stage or info.entry_stage
        mx = self.max_output_tokens
        # max_output_tokens (or "inf": the stage's own max_tokens) is a bound (the protocol's): a long conversation
        # generates up to max_model_len; only a prompt that fills it is refused (then truncated: _start)
        fit = {"max_tokens_fit": True, "reserve_tokens": info.context_reserve if self.modality == "audio" else 0}
        sampling = {text_stage: {"max_tokens": mx, **fit} if isinstance(mx, int) else fit}
        fields = {"prompt": "conversation", "speaker": "session.audio.output.voice",
                  "max_tokens": self.limit_field, "tools": "session.tools"}
        job = Job(f"{self.id}-{uuid.uuid4().hex[:8]}", prompt, sampling, text_stage,
                  info.audio_stage if self.modality == "audio" else None, text_stage, [], fields)
        if self.forced_tool is not None:
            functions = [(t["function"]["name"], t["function"].get("parameters")) for t in self.tools]
            force_call(job, self.forced_tool, functions, None, "session.tools")
            job.audio_stage = None  # a call has no speech
        elif self.tool_parser is not None:
            job.tool_parser = self.tool_parser
            job.voice_after, job.audio_stage = job.audio_stage, None  # a call has no speech
        job.heard_stage = info.recognizer  # a voice agent's: its recognizer's transcript of the turn (cascade.py)
        voice_short_replies(job, info)
        return job

    def outputs(self) -> list[dict[str, Any]]:
        return ([self.item.shape()] if self.opened else []) + [c.shape() for c in self.calls]

    def shape(self, status: str, run: Run | None = None, details: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"object": "realtime.response", "id": self.id, "status": status,
                               "status_details": details,
                               "output": self.outputs() if status != "in_progress" else [],
                               "conversation_id": self.session.id if self.in_conversation else None,
                               "output_modalities": [self.modality], "metadata": self.metadata,
                               "max_output_tokens": self.max_output_tokens,
                               "audio": {"output": {"format": format_shape(self.audio_format),
                                                    "voice": self.voice}}, "usage": None}
        if run is not None:
            # The text stage's prompt split by kind (text, audio, image placeholders); cached_tokens is its
            # prefix-cache hit. Known from the stage's first delta, so a response cancelled (or failed) after its
            # prompt was read reports them as a completed one does (0 only for one cancelled before). The output is
            # the reply's text tokens and its audio's codec tokens (0 until the audio stage finished).
            output = run.completion_tokens + run.audio_tokens
            out["usage"] = {"total_tokens": run.prompt_tokens + output,
                            "input_tokens": run.prompt_tokens, "output_tokens": output,
                            "input_token_details": input_token_details(run),
                            "output_token_details": {"text_tokens": run.completion_tokens,
                                                     "audio_tokens": run.audio_tokens}}
        return out

    async def run(self, job: Job) -> None:
        self.started = True
        session, server = self.session, self.session.server
        item, part, ids = self.item, self.item.parts[0], self.ids
        audio = self.modality == "audio"
        run = Run(server.omni, job, server.settings.default_audio_rate, server.metrics)
        status, details, sent_ms = "completed", None, 0.0
        chunk = max(1, round(RATE * server.settings.audio_chunk_ms / 1000))
        stretch = TimeStretch(self.speed, RATE)  # speed 1: the samples as they are
        g711_out = self.audio_format != "audio/pcm"
        down = Resampler8k24k(up=False) if g711_out else None

        def pieces(samples) -> Iterator[tuple[bytes, float]]:
            """(bytes of a delta, its milliseconds) in the response's format."""
            if down is None:
                for pcm in pcm16_chunks(samples, chunk):
                    yield pcm, len(pcm) / 2 * 1000 / RATE
                return
            narrow = down.push(samples)  # 8 kHz
            step = max(1, chunk // 3)
            for i in range(0, narrow.size, step):
                data = g711.encode(self.audio_format, narrow[i : i + step])
                yield data, len(data) * 1000 / g711.G711_RATE

        async def send_audio(samples) -> None:
            nonlocal sent_ms
            for data, ms in pieces(samples):
                if sent_ms == 0.0 and self.t_turn is not None:
                    server.realtime_metrics.turn_latency.observe(time.monotonic() - self.t_turn)
                sent_ms += ms
                item.timeline.append((sent_ms, len(part.text)))
                await session.send({"type": "response.output_audio.delta", **ids,
                                    "delta": base64.b64encode(data).decode("ascii")})

        parser = ToolCallStream() if self.tool_parser is not None else None

        async def send_text(text: str) -> None:
            if text:
                await self._open()
                part.text += text
                kind = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
                await session.send({"type": kind, **ids, "delta": text})

        heard = None
        try:
            await self.begin()
            if server.info.recognizer is not None:  # a voice agent's turn (realtime/cascade.py)
                if await cascade.transcribe_earlier(session, self.context):  # earlier turns as text
                    run = Run(server.omni, self.job(self.instructions), server.settings.default_audio_rate,
                              server.metrics)
                heard = cascade.HeardTurn.of(session, self.context)
            run = await self._start(run)
            async for ev in run.events():
                if isinstance(ev, HeardEvent):
                    if heard is not None:
                        await heard.on(ev, run)
                    continue
                if isinstance(ev, TextEvent):
                    if self.forced_tool is None:  # (a forced call's JSON is read whole, at the end)
                        await send_text(ev.text if parser is None else parser.feed(ev.text))
                    continue
                if isinstance(ev, AudioEvent):
                    await self._open()
                    samples = ev.samples if ev.rate == RATE else resample(ev.samples, ev.rate, RATE)
                    await send_audio(stretch.push(samples))
            if parser is not None:
                rest, calls = parser.finish()
                await send_text(rest)
                if calls and self.opened:  # the message is whole: it is done before the next item is added
                    item.status = "completed"
                    await self._message_done()
                for call in calls or []:
                    await self._add_call(call)
            if self.forced_tool is not None:
                calls, _ = reply_tool_calls(self.forced_tool, run.text, run.finish_reason)
                if calls is None:  # cut short (max_output_tokens): no complete call, the text as it came
                    await send_text(run.text)
                for call in calls or []:
                    await self._add_call(call)
            await send_audio(stretch.finish())  # what the stretch held back (nothing at speed 1)
            if run.finish_reason == "length":  # the reply hit its token bound: OpenAI's "incomplete"
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            status = "cancelled"
            details = {"type": "cancelled", "reason": self.cancel_reason or "client_cancelled"}
        except ClientGone:  # the socket closed before the session's close cancelled this response
            status, details = "cancelled", {"type": "cancelled", "reason": "session_closed"}
        except ApiError as e:
            status = "failed"
            details = {"type": "failed", "error": {"type": e.type, "code": e.code, "message": e.message}}
            with contextlib.suppress(Exception):
                await session.error(f"the response failed: {e.message}", e.param, e.code, self.event_id, e.type)
        except Exception as e:  # noqa: BLE001 - a bug fails the response, never the session
            logger.exception("realtime response %s failed", self.id)
            status = "failed"
            details = {"type": "failed", "error": {"type": "server_error", "code": "internal_error",
                                                   "message": f"the server failed: {type(e).__name__}"}}
        finally:
            await run.aclose()  # shielded: aborts the request on every stage where it still runs
        await self.end(status, details, run, sent_ms)

    async def _start(self, run: Run) -> Run:
        """The run started; a conversation that outgrew the thinker's context is truncated (session truncation
        "auto", as OpenAI's default): its oldest items leave the prompt, 1, 2, 4, ... at a time, until the prompt
        fits (each try is refused at admission, before any compute)."""
        server, drop = self.session.server, 1
        before = set(self.context.dropped)  # restored if no truncation makes it fit (its instructions are too long)
        while True:
            try:
                await run.start()
                return run
            except ApiError as e:
                if e.code != "context_length_exceeded" or e.param != "conversation":
                    raise
                if self.session.truncation != "auto" or self.context is not self.session.conversation:
                    e.message += ("; the conversation no longer fits the model's context: delete items "
                                  "(conversation.item.delete) or set session.truncation \"auto\"")
                    raise
                if not self.context.drop_oldest(drop, writing=self.item):
                    self.context.dropped = before
                    e.message += ("; the newest item alone does not fit the model's context (truncation leaves it "
                                  "in): send a shorter one, or delete it (conversation.item.delete)")
                    raise
                drop *= 2
                run = Run(server.omni, self.job(self.instructions), server.settings.default_audio_rate,
                          server.metrics)
            except BaseException:  # cancelled while a retry starts: that run is left too (the caller's is not it)
                await run.aclose()
                raise

    async def begin(self) -> None:
        await self.session.send({"type": "response.created", "response": self.shape("in_progress")})
        if self.tool_parser is None and self.forced_tool is None:  # (else the message item waits for content)
            await self._open()

    async def _open(self) -> None:
        """Announce the message item (once)."""
        if self.opened:
            return
        self.opened = True
        session, item = self.session, self.item
        previous = session.conversation.add(item) if self.in_conversation else None
        await session.send({"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                            "item": item.shape()})
        if self.in_conversation:
            await session.send({"type": "conversation.item.added", "previous_item_id": previous,
                                "item": item.shape()})
        await session.send({"type": "response.content_part.added", **self.ids, "part": {
            "type": "audio", "transcript": ""} if self.modality == "audio" else {"type": "text", "text": ""}})

    async def end(self, status: str, details: dict[str, Any] | None, run: Run | None, sent_ms: float) -> None:
        """The response is over: its item settled, the session free for the next one, the done events."""
        item = self.item
        if status == "cancelled" and self.modality == "audio":
            item.truncate_at(sent_ms)  # the text sent with the audio sent
        item.status = "completed" if status == "completed" else "incomplete"
        self.session.response_ended(self)
        if self.in_flight:
            self.in_flight = False
            self.session.server.drain.leave()
            limits.release(self.session)
        self.session.server.realtime_metrics.turns.labels(status=status).inc()
        with contextlib.suppress(Exception):  # the socket may be gone (a disconnect cancels the response)
            if not self.started:  # it never began: announce it, so that its done has a created
                self.started = True
                await self.begin()
            await self._done_events(status, details, run)

    async def _add_call(self, call: dict[str, Any]) -> None:
        """A call read from the reply: a function_call output item (in the conversation, unless out of band)."""
        session, fn = self.session, call["function"]
        item = ConvItem(new_item_id(), "assistant", [], status="in_progress", type="function_call",
                        call_id=call["id"], name=fn["name"], arguments=fn["arguments"])
        index = int(self.opened) + len(self.calls)
        self.calls.append(item)
        await session.send({"type": "response.output_item.added", "response_id": self.id, "output_index": index,
                            "item": item.shape()})
        if self.in_conversation:
            previous = session.conversation.add(item)
            await session.send({"type": "conversation.item.added", "previous_item_id": previous,
                                "item": item.shape()})
        at = {"response_id": self.id, "item_id": item.id, "output_index": index, "call_id": item.call_id}
        await session.send({"type": "response.function_call_arguments.delta", **at, "delta": item.arguments})
        await session.send({"type": "response.function_call_arguments.done", **at, "name": item.name,
                            "arguments": item.arguments})
        item.status = "completed"
        await session.send({"type": "response.output_item.done", "response_id": self.id, "output_index": index,
                            "item": item.shape()})
        if self.in_conversation:
            await session.send({"type": "conversation.item.done", "item": item.shape()})

    async def _done_events(self, status: str, details: dict[str, Any] | None, run: Run | None) -> None:
        if self.opened and not self.message_done:
            await self._message_done()
        await self.session.send({"type": "response.done", "response": self.shape(status, run, details)})

    async def _message_done(self) -> None:
        self.message_done = True
        send, item, part, ids = self.session.send, self.item, self.item.parts[0], self.ids
        if self.modality == "audio":
            await send({"type": "response.output_audio.done", **ids})
            await send({"type": "response.output_audio_transcript.done", **ids, "transcript": part.text})
            done_part = {"type": "audio", "transcript": part.text}
        else:
            await send({"type": "response.output_text.done", **ids, "text": part.text})
            done_part = {"type": "text", "text": part.text}
        await send({"type": "response.content_part.done", **ids, "part": done_part})
        await send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0,
                    "item": item.shape()})
        if self.in_conversation:
            await send({"type": "conversation.item.done", "item": item.shape()})


def new_response(session: Session, rid: str, modality: str, voice: str | None, max_output_tokens: int | str
                 ) -> RealtimeResponse:
    kind = "output_audio" if modality == "audio" else "output_text"
    return RealtimeResponse(session, rid, ConvItem(new_item_id(), "assistant", [Part(kind)], status="in_progress"),
                            modality, voice, max_output_tokens)
