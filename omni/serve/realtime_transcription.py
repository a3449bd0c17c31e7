"""Input audio transcription of a `/v1/realtime` session (`session.audio.input.transcription`).

OpenAI's sessions name a speech-to-text model; an omni pipeline has its own: the thinker hears audio and
writes text, so the pipeline's text stage transcribes each committed audio item, in a request of its own
(the clip and an instruction to transcribe it, greedy, text only) that runs beside the response:

    conversation.item.input_audio_transcription.delta       the transcript as it streams (item_id, content_index)
    conversation.item.input_audio_transcription.completed   the whole transcript, and the request's token usage
    conversation.item.input_audio_transcription.failed      why it failed (the session goes on)

The item's input_audio part keeps the transcript (`conversation.item.retrieve` shows it). The conversation's
prompt never uses it: the model hears the audio itself. Whatever `model` the client names (OpenAI's clients
send "whisper-1", "gpt-4o-transcribe", ...), the pipeline's own text stage transcribes; the session shows the
name it was given. `language` (ISO-639-1) and `prompt` become part of the instruction.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from typing import Any

from omni.outputs import MultiModalInput, StageInput
from omni.serve.errors import ApiError
from omni.serve.realtime_conversation import ConvItem, Part
from omni.serve.reply_stream import Run, TextEvent
from omni.serve.translate import Job

logger = logging.getLogger(__name__)
# Qwen2.5-Omni's and Qwen3-Omni's speech recognition prompts: a system turn saying what the model is, and the
# clip with an instruction to write down what is said.
ASR_SYSTEM = "You are a speech recognition model."
ASR_INSTRUCTION = "Transcribe the audio into text."
# Generous for speech (~3 words, ~4 tokens a second): the bound only stops a model that does not stop.
TOKENS_PER_SECOND, MIN_TOKENS = 12, 32


def instruction(language: str | None, prompt: str | None) -> str:
    text = ASR_INSTRUCTION
    if language:
        text += f" The speech is in the language whose ISO-639-1 code is {language}."
    if prompt:
        text += f" Context: {prompt}"
    return text


def transcription_job(info: Any, part: Part, language: str | None, prompt: str | None) -> Job:
    """The clip of an input_audio part, and the instruction, as one text-only request to the text stage."""
    stage = info.text_stage or info.entry_stage
    messages = [{"role": "system", "content": ASR_SYSTEM},
                {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction(language, prompt)}]}]
    media = [MultiModalInput("audio", part.audio, sampling_rate=part.audio_rate)]
    seconds = len(part.audio) / part.audio_rate
    sampling = {stage: {"temperature": 0.0, "max_tokens": max(MIN_TOKENS, math.ceil(seconds * TOKENS_PER_SECOND))}}
    fields = {"prompt": "session.audio.input.transcription", "max_tokens": "session.audio.input.transcription"}
    return Job(f"transcribe-{uuid.uuid4().hex[:12]}", StageInput("", prompt=messages, mm_inputs=media), sampling,
               stage, None, stage, [], fields)


class Transcriptions:
    """A session's transcriptions in flight (one per committed audio item), cancelled when the session ends."""

    def __init__(self, session: Any):
        self.session = session
        self.tasks: set[asyncio.Task] = set()

    def start(self, item: ConvItem, config: dict[str, Any]) -> None:
        part = next(p for p in item.parts if p.kind == "input_audio")
        task = asyncio.create_task(self._run(item, part, config))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, item: ConvItem, part: Part, config: dict[str, Any]) -> None:
        session, server = self.session, self.session.server
        ids = {"item_id": item.id, "content_index": item.parts.index(part)}
        job = transcription_job(server.info, part, config.get("language"), config.get("prompt"))
        run = Run(server.omni, job, server.settings.default_audio_rate)
        text = ""
        try:
            await run.start()
            async for ev in run.events():
                if isinstance(ev, TextEvent) and ev.text:
                    text += ev.text
                    await session.send({"type": "conversation.item.input_audio_transcription.delta", **ids,
                                        "delta": ev.text})
        except asyncio.CancelledError:
            raise  # the session closed: its socket is gone, nothing to say
        except Exception as e:  # noqa: BLE001 - a failed transcription fails alone; the session goes on
            error = ({"type": e.type, "code": e.code, "message": e.message, "param": e.param}
                     if isinstance(e, ApiError) else
                     {"type": "server_error", "code": "internal_error", "message": f"the server failed: "
                                                                                  f"{type(e).__name__}",
                      "param": None})
            if not isinstance(e, ApiError):
                logger.exception("realtime transcription of %s failed", item.id)
            with contextlib.suppress(Exception):
                await session.send({"type": "conversation.item.input_audio_transcription.failed", **ids,
                                    "error": error})
            return
        finally:
            await run.aclose()
        part.transcript = text
        usage = {"type": "tokens", "total_tokens": run.prompt_tokens + run.completion_tokens,
                 "input_tokens": run.prompt_tokens, "output_tokens": run.completion_tokens,
                 "input_token_details": {"text_tokens": run.prompt_tokens, "audio_tokens": 0}}
        with contextlib.suppress(Exception):  # the socket may be gone
            await session.send({"type": "conversation.item.input_audio_transcription.completed", **ids,
                                "transcript": text, "usage": usage})

    async def close(self) -> None:
        """Cancel what runs (each request aborted on every stage) and wait for it."""
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
