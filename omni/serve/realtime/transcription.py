"""Input audio transcription of a `/v1/realtime` session (`session.audio.input.transcription`).

OpenAI's sessions name a speech-to-text model; an omni pipeline has its own: the thinker hears audio and
writes text, so the pipeline's text stage transcribes each committed audio item, in a request of its own
(generation/asr_job.py: the clip and an instruction to transcribe it, greedy, text only) that runs beside the response:

    conversation.item.input_audio_transcription.delta       the transcript as it streams (item_id, content_index)
    conversation.item.input_audio_transcription.completed   the whole transcript, and the request's token usage
    conversation.item.input_audio_transcription.failed      why it failed (the session goes on)

The item's input_audio part keeps the transcript (`conversation.item.retrieve` shows it). The conversation's
prompt never uses it: the model hears the audio itself. Whatever `model` the client names (OpenAI's clients
send "whisper-1", "gpt-4o-transcribe", ...), the pipeline's own text stage transcribes; the session shows the
name it was given. `language` (ISO-639-1) and `prompt` become part of the instruction. A session transcribes at
most --max-session-responses items at once, each counted in the server's admission (realtime/limits.py): past
either bound, that item's transcription fails (code session_response_limit, overloaded).

On a voice agent's cascade (realtime/cascade.py) the response's own recognizer transcribes its turn: no request
of its own at commit; `transcribe` serves only a turn no response heard, before the next response runs.
"""
from __future__ import annotations

import asyncio
import time
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from omni.serve.generation.asr_job import asr_job, asr_usage
from omni.serve.generation.run import Run, TextEvent
from omni.serve.generation.transcript import Transcript
from omni.serve.http.errors import ApiError
from omni.serve.realtime import limits
from omni.serve.realtime.hub import ClientGone
from omni.serve.realtime.conversation import ConvItem, Part

if TYPE_CHECKING:
    from omni.serve.realtime.session import Session

logger = logging.getLogger(__name__)


class Transcriptions:
    """A session's transcriptions in flight (one per committed audio item), cancelled when the session ends."""

    def __init__(self, session: Session):
        self.session = session
        self.tasks: set[asyncio.Task] = set()
        self.ended_at = 0.0  # time.monotonic() when the last one ended (the session's idle clock starts there)


    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.ended_at = time.monotonic()

    def start(self, item: ConvItem, config: dict[str, Any]) -> None:
        part = next(p for p in item.parts if p.kind == "input_audio")
        task = asyncio.create_task(self._run(item, part, config))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    async def _run(self, item: ConvItem, part: Part, config: dict[str, Any]) -> None:
        session, server = self.session, self.session.server
        limit = server.settings.max_session_responses  # a session's transcriptions at once: its responses' bound
        try:
            if len(self.tasks) > limit:
                raise ApiError(429, f"this session transcribes {len(self.tasks) - 1} items, its limit "
                               f"(--max-session-responses {limit}); commit again once one is done",
                               code="session_response_limit")
            server.state.admit()  # a pipeline request, counted as a response is (realtime/limits.py); 503: failed
        except ApiError as e:
            with contextlib.suppress(Exception):
                await _failed(session, item, part, e)
            return
        try:
            await transcribe(session, item, part, config)
        finally:
            limits.release(session)

    async def close(self) -> None:
        """Cancel what runs (each request aborted on every stage) and wait for it."""
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def _failed(session: Session, item: ConvItem, part: Part, e: Exception) -> None:
    error = ({"type": e.type, "code": e.code, "message": e.message, "param": e.param} if isinstance(e, ApiError)
             else {"type": "server_error", "code": "internal_error",
                   "message": f"the server failed: {type(e).__name__}", "param": None})
    await session.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item.id,
                        "content_index": item.parts.index(part), "error": error})


async def transcribe(session: Session, item: ConvItem, part: Part, config: dict[str, Any]) -> None:
    """`part`'s transcription, its events sent and its transcript kept (a request admitted by the caller); a
    failure is the `.failed` event (the session goes on)."""
    server = session.server
    ids = {"item_id": item.id, "content_index": item.parts.index(part)}
    job = asr_job(server.info, part.audio, part.audio_rate, language=config.get("language"),
                  prompt=config.get("prompt"), fields={"prompt": "session.audio.input.transcription",
                                                       "max_tokens": "session.audio.input.transcription"})
    run = Run(server.omni, job, server.settings.default_audio_rate)
    transcript = Transcript(server.info.transcript_marker)
    try:
        await run.start()
        async for ev in run.events():  # a speech recognizer's language tag is held back and dropped
            delta = transcript.feed(ev.text) if isinstance(ev, TextEvent) and ev.text else ""
            if delta:
                await session.send({"type": "conversation.item.input_audio_transcription.delta", **ids,
                                    "delta": delta})
        if delta := transcript.finish():
            await session.send({"type": "conversation.item.input_audio_transcription.delta", **ids, "delta": delta})
    except asyncio.CancelledError:
        raise  # the session closed: its socket is gone, nothing to say
    except ClientGone:  # ... or the socket closed first
        return
    except Exception as e:  # noqa: BLE001 - a failed transcription fails alone; the session goes on
        if not isinstance(e, ApiError):
            logger.exception("realtime transcription of %s failed", item.id)
        with contextlib.suppress(Exception):
            await _failed(session, item, part, e)
        return
    finally:
        await run.aclose()
    part.transcript = text = transcript.text
    with contextlib.suppress(Exception):  # the socket may be gone
        await session.send({"type": "conversation.item.input_audio_transcription.completed", **ids,
                            "transcript": text, "usage": asr_usage(run)})
