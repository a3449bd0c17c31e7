"""One `/v1/realtime` session: its configuration, input audio buffer, turn detection, conversation and
the responses it runs (realtime/websocket.py owns the socket and hands every client event here).

    client event                     what it does                              server events
    session.update                   modalities, instructions, voice, turn     session.updated
                                     detection, transcription, tools,
                                     max_output_tokens
    input_audio_buffer.append        pcm16 24 kHz into the buffer; server      speech_started / _stopped, then
                                     VAD commits on speech stop, answers       as commit and response.create
    input_audio_buffer.commit        the buffer becomes a user audio item      committed, conversation.item.*
                                     (transcribed, when the session asks)      ...input_audio_transcription.*
    input_audio_buffer.clear                                                   cleared
    conversation.item.create         a user / assistant / system item (text,   conversation.item.added / done
                                     audio, images: realtime/items.py), a
                                     function call or its output
    conversation.item.delete / truncate / retrieve                             .deleted / .truncated / .retrieved
    response.create                  the conversation -> the pipeline          response.created ... .done
    response.cancel                  its request aborted on every stage        response.done (cancelled)

A response (realtime/response.py) runs the whole conversation as one request (realtime/conversation.py:
every turn's prompt starts with the previous one, so the stages' prefix caches hold all but the new turn).
One conversation response at a time: `response.cancel`, a barge-in (speech starting while it runs, with
server VAD's `interrupt_response`) and a closed socket cancel it. Out-of-band responses (`conversation:
"none"`) run beside it (up to the session's bound): their items stay out of the conversation, their context is the
conversation or their own `input`; only their own `response.cancel` (by id) or the socket's close cancels
them. What a session may hold (responses at once, the conversation's size) is bounded: realtime/limits.py.
Any refused client event is an `error` event naming the event and field; the session goes on. On a voice agent's
cascade (a speech recognizer, an LLM, a TTS) the protocol is the same: realtime/cascade.py says what differs.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from omni.serve.audio.resampling import resample
from omni.serve.protocol import realtime as E
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import ConvItem, Conversation, Part, new_item_id
from omni.serve.realtime import cascade, checks, limits
from omni.serve.realtime.hub import RealtimeHub
from omni.serve.realtime.input_audio import InputAudio
from omni.serve.realtime.items import client_item, response_context
from omni.serve.realtime.response import RATE, RealtimeResponse, format_shape, new_response
from omni.serve.realtime.transcription import Transcriptions

# OpenAI's server VAD defaults: a session starts with them, and a turn detection turned on again starts from them
DEFAULT_TURN = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                "create_response": True, "interrupt_response": True}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Session:
    def __init__(self, server: RealtimeHub, send: Callable[[dict[str, Any]], Awaitable[None]], model: str):
        self.server, self._send, self.id = server, send, _id("sess")
        s = server.settings
        self.model = model
        self.instructions: str | None = None
        self.modality = "audio" if server.info.audio_stage is not None else "text"
        self.voice: str | None = None
        self.speed = 1.0  # session.audio.output.speed: the reply audio's tempo (its pitch kept)
        # session.audio.output.format.type: pcm16 at 24 kHz, or G.711 at 8 kHz (audio/g711.py); the input's is the
        # input audio's (everything in the session runs at RATE)
        self.output_format = "audio/pcm"
        self.max_output_tokens: int | str = "inf"
        self.tools: list[E.RealtimeTool] = []  # session.tools: functions the model may call
        self.tool_choice: str | E.FunctionChoice = "auto"
        self._ended_at = 0.0  # when the last response ended
        # "auto" (OpenAI's default): a conversation that outgrew the thinker's context loses its oldest items from
        # the prompts (Conversation.drop_oldest); "disabled": such a response fails, naming the conversation
        self.truncation = "auto"
        self.turn: dict[str, Any] | None = dict(DEFAULT_TURN)
        self.conversation = Conversation()
        # session.audio.input.transcription ({model, language, prompt}), or None: each committed audio item is
        # transcribed by the pipeline's text stage beside the response (realtime/transcription.py)
        self.transcription: dict[str, Any] | None = None
        self.transcriptions = Transcriptions(self)
        self.input_audio = InputAudio(s.max_media_bytes // 4, server.vad_models)
        self.response: RealtimeResponse | None = None  # the conversation's response in progress
        self.out_of_band: dict[str, RealtimeResponse] = {}  # response.conversation "none", by id
        self.turn_t0: float | None = None

    # ------------------------------------------------------------------ out
    async def send(self, event: dict[str, Any]) -> None:
        await self._send({"event_id": _id("event"), **event})

    async def error(self, message: str, param: str | None = None, code: str | None = None,
                    event_id: str | None = None, kind: str = "invalid_request_error") -> None:
        await self.send({"type": "error", "error": {"type": kind, "code": code, "message": message,
                                                    "param": param, "event_id": event_id}})

    def shape(self) -> dict[str, Any]:
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
                "output_modalities": [self.modality], "instructions": self.instructions or "",
                "audio": {"input": {"format": format_shape(self.input_audio.format), "turn_detection": self.turn,
                                    "transcription": self.transcription, "noise_reduction": None},
                          "output": {"format": format_shape(self.output_format), "voice": self.voice,
                                     "speed": self.speed}},
                "max_output_tokens": self.max_output_tokens,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools],
                "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, E.FunctionChoice)
                                else self.tool_choice),
                "tracing": None, "truncation": self.truncation, "include": None, "prompt": None}

    async def start(self) -> None:
        await self.send({"type": "session.created", "session": self.shape()})

    # ------------------------------------------------------------------- in
    async def handle(self, text: str | bytes) -> None:
        """One client message; a refused one is an error event (never an exception)."""
        try:
            ev = E.parse_client_event(text)
            await getattr(self, "_on_" + ev.type.replace(".", "_"))(ev)
        except RealtimeEventError as e:
            await self.error(e.message, e.param, e.code, e.event_id, e.kind)

    async def _on_session_update(self, ev: E.SessionUpdate) -> None:
        """Every field is checked (and the VAD, when turned on, loaded) before any is applied: a refused update
        changes nothing, as the client is told only by `session.updated`."""
        cfg = ev.session
        if cfg.model is not None and cfg.model != self.model:
            raise RealtimeEventError(f"session.model: this server serves `{self.model}`, not `{cfg.model}`",
                                     "session.model", "model_not_found", ev.event_id)
        if cfg.output_modalities is not None:
            checks.modality(self.server, self.model, cfg.output_modalities[0], "session.output_modalities",
                            ev.event_id)
        audio = cfg.audio
        inp = audio.input if audio is not None else None
        out = audio.output if audio is not None else None
        voice = None
        if out is not None and out.voice is not None:
            voice = out.voice if isinstance(out.voice, str) else out.voice.id
            checks.voice(self.server, voice, "session.audio.output.voice", ev.event_id)
        tools, choice = self.tools, self.tool_choice
        if cfg.tools is not None or cfg.tool_choice is not None:
            tools = self.tools if cfg.tools is None else cfg.tools
            choice = cfg.tool_choice or self.tool_choice
            checks.tools(self.server, self.model, tools, choice, "session", ev.event_id)
        td_set = inp is not None and "turn_detection" in inp.model_fields_set
        if td_set and inp.turn_detection is not None and self.input_audio.vad is None:  # the last step that may fail
            await self.input_audio.load_vad(ev.event_id, self.input_audio.clock_ms)
        # ---- applied
        if cfg.output_modalities is not None:
            self.modality = cfg.output_modalities[0]
        if td_set:
            td = inp.turn_detection
            if td is None:
                self.turn = None
                self.input_audio.drop_vad()
            else:
                base = self.turn or DEFAULT_TURN
                self.turn = {**base, **td.model_dump(exclude_none=True, exclude={"idle_timeout_ms"})}
                self.input_audio.vad.configure(self.turn["threshold"], self.turn["prefix_padding_ms"],
                                   self.turn["silence_duration_ms"])
        if inp is not None and "transcription" in inp.model_fields_set:
            tr = inp.transcription
            self.transcription = None if tr is None else {"model": tr.model or self.model, "language": tr.language,
                                                          "prompt": tr.prompt}
        if voice is not None:
            self.voice = voice
        if out is not None and out.speed is not None:
            self.speed = float(out.speed)
        if inp is not None and inp.format is not None:
            self.input_audio.set_format(inp.format.type)
        if out is not None and out.format is not None:
            self.output_format = out.format.type
        if cfg.instructions is not None:
            self.instructions = cfg.instructions
        if cfg.max_output_tokens is not None:
            self.max_output_tokens = cfg.max_output_tokens
        if cfg.truncation is not None:
            self.truncation = cfg.truncation
        self.tools, self.tool_choice = tools, choice
        await self.send({"type": "session.updated", "session": self.shape()})

    async def _on_input_audio_buffer_append(self, ev: E.AudioAppend) -> None:
        buf = self.input_audio
        samples = buf.decode(ev.audio, ev.event_id)
        buf.append(samples, ev.event_id)
        if buf.vad is None and self.turn is not None:
            await buf.load_vad(ev.event_id, buf.clock_ms - samples.size * 1000 / RATE)
        if buf.vad is None:
            return
        for vad_ev, ms in await buf.detect(samples):
            if vad_ev.kind == "speech_started":
                buf.speech_start_ms = ms
                await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms,
                                 "item_id": buf.pending_item_id})
                if self.response is not None and self.turn and self.turn.get("interrupt_response", True):
                    self.server.realtime_metrics.barge_ins.inc()
                    await self.cancel_response("turn_detected")
            else:
                await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms,
                                 "item_id": buf.pending_item_id})
                await self._commit(None, trim_from_ms=buf.speech_start_ms)
                if self.turn and self.turn.get("create_response", True) and self.response is None:
                    await self._create_response(None, None)

    async def _on_input_audio_buffer_commit(self, ev: E.AudioCommit) -> None:
        await self._commit(ev.event_id)

    async def _commit(self, event_id: str | None, trim_from_ms: float | None = None) -> None:
        audio = self.input_audio.committable(event_id, trim_from_ms)
        self.turn_t0 = time.monotonic()
        model_rate = self.server.settings.audio_input_rate
        wave = await asyncio.to_thread(resample, audio, RATE, model_rate)
        item = ConvItem(self.input_audio.pending_item_id, "user",
                        [Part("input_audio", audio=wave, audio_rate=model_rate)])
        if event_id is None:  # a server VAD turn: one the conversation cannot hold is dropped, not kept for later
            self.input_audio.clear()
        limits.check_room(self, item, event_id)
        self.input_audio.clear()
        previous = self.conversation.add(item)
        await self.send({"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous})
        await self._item_added(item, previous)
        # (a voice agent's turn is transcribed by its response's own recognizer: realtime/cascade.py)
        if self.transcription is not None and self.server.info.recognizer is None:
            self.transcriptions.start(item, self.transcription)

    async def _on_input_audio_buffer_clear(self, ev: E.AudioClear) -> None:
        self.input_audio.restart()
        await self.send({"type": "input_audio_buffer.cleared"})

    async def _item_added(self, item: ConvItem, previous: str | None) -> None:
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.shape()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.shape()})

    async def _on_conversation_item_create(self, ev: E.ItemCreate) -> None:
        it, eid = ev.item, ev.event_id
        if it.id is not None and self.conversation.find(it.id) is not None:
            raise RealtimeEventError(f"item.id: an item {it.id!r} exists already", "item.id", "duplicate_item_id", eid)
        if isinstance(it, E.Item):
            item = await client_item(it, "item", eid, self, self.conversation)
        elif isinstance(it, E.FunctionCallItem):
            item = ConvItem(it.id or new_item_id(), "assistant", [], type="function_call", call_id=it.call_id,
                            name=it.name, arguments=it.arguments)
        else:
            item = ConvItem(it.id or new_item_id(), "user", [], type="function_call_output", call_id=it.call_id,
                            output=it.output)
        limits.check_room(self, item, eid)
        try:
            previous = self.conversation.add(item, ev.previous_item_id)
        except KeyError:
            raise RealtimeEventError(f"previous_item_id: no item {ev.previous_item_id!r} in the conversation",
                                     "previous_item_id", "item_not_found", eid) from None
        await self._item_added(item, previous)

    def _item(self, item_id: str, event_id: str | None) -> ConvItem:
        item = self.conversation.find(item_id)
        if item is None:
            raise RealtimeEventError(f"item_id: no item {item_id!r} in the conversation", "item_id",
                                     "item_not_found", event_id)
        return item

    async def _on_conversation_item_delete(self, ev: E.ItemDelete) -> None:
        item = self._item(ev.item_id, ev.event_id)
        if self.response is not None and self.response.item is item:
            raise RealtimeEventError("item_id: the response in progress writes this item; cancel it first",
                                     "item_id", "item_in_use", ev.event_id)
        self.conversation.delete(ev.item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": ev.item_id})

    async def _on_conversation_item_truncate(self, ev: E.ItemTruncate) -> None:
        item = self._item(ev.item_id, ev.event_id)
        if item.role != "assistant" or not any(p.kind == "output_audio" for p in item.parts):
            raise RealtimeEventError("item_id: only an assistant item with output audio can be truncated",
                                     "item_id", "invalid_value", ev.event_id)
        if ev.content_index >= len(item.parts) or item.parts[ev.content_index].kind != "output_audio":
            raise RealtimeEventError(f"content_index: {ev.content_index} is not the item's output_audio part",
                                     "content_index", "invalid_value", ev.event_id)
        if self.response is not None and self.response.item is item:
            # the user interrupted the reply still being made: it stops on every stage (keeping what was sent),
            # then the truncation below keeps what was heard, so the next turn's prompt holds nothing more
            await self.cancel_response("client_cancelled")
        if ev.audio_end_ms > item.audio_ms + 1:
            raise RealtimeEventError(f"audio_end_ms: {ev.audio_end_ms} ms is past the item's audio "
                                     f"({item.audio_ms:.0f} ms)", "audio_end_ms", "invalid_value", ev.event_id)
        item.truncate_at(ev.audio_end_ms)
        await self.send({"type": "conversation.item.truncated", "item_id": item.id,
                         "content_index": ev.content_index, "audio_end_ms": ev.audio_end_ms})

    async def _on_conversation_item_retrieve(self, ev: E.ItemRetrieve) -> None:
        item = self._item(ev.item_id, ev.event_id)
        await self.send({"type": "conversation.item.retrieved", "item": item.shape()})

    # ------------------------------------------------------------ responses
    async def _on_response_create(self, ev: E.ResponseCreate) -> None:
        out_of_band = ev.response is not None and ev.response.conversation == "none"
        if self.response is not None and not out_of_band:
            raise RealtimeEventError(f"response.create: response {self.response.id} is still in progress; "
                                     "wait for its response.done or cancel it", None,
                                     "conversation_already_has_active_response", ev.event_id)
        await self._create_response(ev.response, ev.event_id)

    async def _on_response_cancel(self, ev: E.ResponseCancel) -> None:
        if ev.response_id in self.out_of_band:
            await self._cancel(self.out_of_band[ev.response_id], "client_cancelled")
            return
        if self.response is None or (ev.response_id is not None and ev.response_id != self.response.id):
            raise RealtimeEventError("response.cancel: no response in progress" + (
                f" with id {ev.response_id!r}" if ev.response_id else ""), "response_id" if ev.response_id else None,
                "response_cancel_not_active", ev.event_id)
        await self.cancel_response("client_cancelled")

    async def cancel_response(self, reason: str) -> None:
        """Cancel the conversation's response in progress (its request aborted on every stage) and wait for
        its end."""
        if self.response is not None:
            await self._cancel(self.response, reason)

    @property
    def busy(self) -> bool:
        """A response or a transcription runs: the client is waiting for its events."""
        return self.response is not None or bool(self.out_of_band) or bool(self.transcriptions.tasks)

    async def _cancel(self, resp: RealtimeResponse, reason: str) -> None:
        if resp.task is None:
            return
        resp.cancel_reason = reason
        resp.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await resp.task
        if not resp.started:  # cancelled before it ran: it still ends, as every response does
            await resp.end("cancelled", {"type": "cancelled", "reason": reason}, None, 0.0)

    def response_ended(self, resp: RealtimeResponse) -> None:
        if self.response is resp:
            self.response = None
        self.out_of_band.pop(resp.id, None)
        self._ended_at = time.monotonic()

    @property
    def quiet_since(self) -> float:
        """time.monotonic() when the session last stopped being busy (its idle clock runs from there, or from the
        client's last event, whichever is later)."""
        return max(self._ended_at, self.transcriptions.ended_at)

    async def _create_response(self, params: E.ResponseParams | None, event_id: str | None) -> None:
        drain = self.server.drain
        if drain.draining:  # the server is shutting down: what runs may finish, nothing new starts
            raise RealtimeEventError("the server is shutting down: it starts no new response", None,
                                     "shutting_down", event_id)
        modality = self.modality
        instructions = self.instructions
        out_of_band = params is not None and params.conversation == "none"
        context = self.conversation
        if params is not None and params.input is not None:
            context = await response_context(params.input, event_id, self)
        if self.server.info.recognizer is not None:
            cascade.check_turn(context, event_id)  # a turn to answer: the newest user message
        voice, max_tokens, speed, out_format = self.voice, self.max_output_tokens, self.speed, self.output_format
        tools, tool_choice = self.tools, self.tool_choice
        if params is not None:
            if params.output_modalities is not None:
                modality = params.output_modalities[0]
                checks.modality(self.server, self.model, modality, "response.output_modalities", event_id)
            if params.instructions is not None:
                instructions = params.instructions
            if params.audio and params.audio.output and params.audio.output.voice is not None:
                v = params.audio.output.voice
                voice = v if isinstance(v, str) else v.id
                checks.voice(self.server, voice, "response.audio.output.voice", event_id)
            if params.audio and params.audio.output and params.audio.output.speed is not None:
                speed = float(params.audio.output.speed)
            if params.audio and params.audio.output and params.audio.output.format is not None:
                out_format = params.audio.output.format.type
            if params.max_output_tokens is not None:
                max_tokens = params.max_output_tokens
            if params.tools is not None or params.tool_choice is not None:
                tools = tools if params.tools is None else params.tools
                tool_choice = params.tool_choice or tool_choice
                checks.tools(self.server, self.model, tools, tool_choice, "response", event_id)
        resp = new_response(self, _id("resp"), modality, voice, max_tokens)
        resp.event_id = event_id  # a failure's error event names the response.create that asked for it
        resp.limit_field = ("response.max_output_tokens" if params is not None and params.max_output_tokens
                            is not None else "session.max_output_tokens")
        resp.speed, resp.audio_format = speed, out_format
        resp.in_conversation, resp.context = not out_of_band, context
        resp.metadata = params.metadata if params is not None else None
        resp.tools = [t.as_chat_tool() for t in tools]
        resp.tool_parser = self.server.settings.tool_call_parser if tools and tool_choice == "auto" else None
        resp.forced_tool = E.forced_tool(tool_choice) if tools else None
        if not out_of_band:  # the turn's latency is the conversation's response's
            resp.t_turn, self.turn_t0 = self.turn_t0, None
        job = resp.job(instructions)
        if not job.prompt.prompt:  # an out-of-band `input: []` without instructions: nothing to answer
            raise RealtimeEventError("response.input: an empty input needs instructions (the model would be asked "
                                     "nothing)", "response.input", "invalid_value", event_id)
        limits.admit_response(self, event_id)
        if out_of_band:
            self.out_of_band[resp.id] = resp
        else:
            self.response = resp
        # In flight for the server's drain and admission until it ends (RealtimeResponse.end): a shutdown waits
        # for it up to the grace period, as for an HTTP request.
        drain.enter()
        resp.in_flight = True
        resp.task = asyncio.create_task(resp.run(job))

    async def close(self) -> None:
        """The socket is gone: the response in progress and the transcriptions are cancelled (their requests
        aborted everywhere)."""
        await self.cancel_all("session_closed")
        await self.transcriptions.close()
        self.input_audio.drop_vad()

    async def cancel_all(self, reason: str) -> None:
        """Cancel every response in progress, the conversation's and the out-of-band ones."""
        await self.cancel_response(reason)
        for resp in list(self.out_of_band.values()):
            await self._cancel(resp, reason)
