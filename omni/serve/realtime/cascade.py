"""A `/v1/realtime` session on a voice agent's cascade: a pipeline whose entry stage is a speech recognizer with
stages after it (PipelineInfo.recognizer: Qwen3-ASR -> a chat LLM -> a TTS and its codec), not an omni model that
hears the audio itself. The protocol is the same; what differs is what a turn sends and where its events come from:

    the prompt        the conversation so far, each earlier user turn as its transcript (the text the LLM read
                      then: the prompts keep one prefix for the LLM's cache), assistant turns as their text, and
                      the newest user turn's audio as the clip the recognizer hears (realtime/conversation.py)
    its transcript    the recognizer's reply in the same request (Job.heard_stage), its language tag dropped:
                      `conversation.item.input_audio_transcription.delta` / `.completed` on the user item, whose
                      input_audio part keeps it (the text later turns send for it); no request of its own
    the reply         the LLM's text (response.output_audio_transcript.delta / output_text.delta), the codec's
                      audio (response.output_audio.delta); usage is the LLM's (cached_tokens: its prefix hit)

A typed newest turn is answered as it is: the recognizer has nothing to hear (an empty transcript at once, its model's
forced reply) and the LLM reads the text. A response with no user turn at all is refused at response.create. A user
turn whose audio never got its transcript (its response was cancelled before the recognizer
finished, or no response answered it) is transcribed on its own (realtime/transcription.py) before the next response
runs, so that every earlier turn is text. Cancelling a response aborts its one request on every stage at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from omni.serve.generation.asr_job import asr_usage
from omni.serve.generation.run import HeardEvent, Run
from omni.serve.generation.transcript import Transcript
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import ConvItem, Conversation, Part
from omni.serve.realtime.transcription import transcribe

if TYPE_CHECKING:
    from omni.serve.realtime.session import Session

logger = logging.getLogger(__name__)
# An earlier turn's own transcription waits at most this long (then its turn is left out of the prompt)
TRANSCRIBE_TIMEOUT_S = 120.0


def heard_part(context: Conversation) -> tuple[ConvItem, Part] | None:
    """The newest user turn and its clip the recognizer hears (its last input_audio part), or None."""
    item = context.last_user()
    part = next((p for p in reversed(item.parts) if p.kind == "input_audio" and p.audio is not None),
                None) if item is not None else None
    return None if part is None else (item, part)


def check_turn(context: Conversation, event_id: str | None) -> None:
    """A cascade answers the user: its conversation holds a user turn (spoken, or typed: the recognizer then hears
    nothing and the LLM reads the text)."""
    if context.last_user() is None:
        raise RealtimeEventError("response.create: this pipeline is a voice agent: the conversation holds no user "
                                 "turn to answer (input_audio_buffer.commit, or a user message)", None,
                                 "unsupported_value", event_id)


async def transcribe_earlier(session: Session, context: Conversation) -> bool:
    """Transcribe every earlier user turn's audio that has no transcript yet (in turn, each bounded by
    TRANSCRIBE_TIMEOUT_S); True when any was (the prompt changed)."""
    newest = heard_part(context)
    todo = [(i, p) for i in context.items if i.id not in context.dropped and i.type == "message" and i.role == "user"
            for p in i.parts if p.kind == "input_audio" and p.audio is not None and p.transcript is None
            and (newest is None or p is not newest[1])]
    config = session.transcription or {}
    for item, part in todo:
        try:
            await asyncio.wait_for(transcribe(session, item, part, config), TRANSCRIBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("realtime transcription of %s took over %.0f s: its turn is left out of the prompt",
                           item.id, TRANSCRIBE_TIMEOUT_S)
    return bool(todo)


class HeardTurn:
    """The recognizer's reply in a response's request, as the newest user turn's transcription events."""

    def __init__(self, session: Session, item: ConvItem, part: Part):
        self.session, self.part = session, part
        self.ids = {"item_id": item.id, "content_index": item.parts.index(part)}
        self.transcript = Transcript(session.server.info.transcript_marker)

    @classmethod
    def of(cls, session: Session, context: Conversation) -> HeardTurn | None:
        """None when the turn has its transcript already (a response to it again: its events were sent)."""
        heard = heard_part(context)
        return None if heard is None or heard[1].transcript is not None else cls(session, *heard)

    async def on(self, ev: HeardEvent, run: Run) -> None:
        delta = self.transcript.feed(ev.text) if ev.text else ""
        if ev.done:
            delta += self.transcript.finish()
        if delta:
            await self.session.send({"type": "conversation.item.input_audio_transcription.delta", **self.ids,
                                     "delta": delta})
        if ev.done:
            self.part.transcript = self.transcript.text
            with contextlib.suppress(Exception):  # the socket may be gone
                await self.session.send({"type": "conversation.item.input_audio_transcription.completed",
                                         **self.ids, "transcript": self.transcript.text,
                                         "usage": asr_usage(run.heard)})
