"""Qwen3-ASR as the ears of a voice agent: its transcript becomes the user's turn of the conversation a text LLM
continues (`qwen3_asr_to_chat`, registered in stages/__init__.py).

    asr  (model_kwargs.in_conversation)   the conversation's last clip -> "language English<asr_text>The text."
    llm  (any causal LM)                  the conversation, the last user turn's audio replaced by its transcript

The transcript is read as `Qwen3ASRProcessor.parse_output` reads it: the text after `<asr_text>`, stripped (no marker:
the whole reply). The conversation is the request's own chat messages (or none: the transcript alone is the user's
turn); audio in any earlier user turn is refused, naming it (an LLM hears nothing: give earlier turns as text).
"""
from __future__ import annotations

import copy
from typing import Any

from omni.errors import RequestError
from omni.messages import StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.qwen3_asr.info import ASR

EDGE = "qwen3_asr_to_chat"


def transcript(reply: str) -> str:
    """The transcript in a Qwen3-ASR reply (its language tag dropped)."""
    marker = ASR.transcript_marker or ""
    return (reply.split(marker, 1)[1] if marker and marker in reply else reply).strip()


def _is_audio(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("audio", "input_audio", "audio_url")


def with_transcript(prompt: Any, text: str) -> list[dict[str, Any]]:
    """The conversation with the last user turn's audio replaced by `text` (a typed last turn, or a text prompt: the
    conversation as it is, and an empty transcript adds nothing)."""
    if not isinstance(prompt, list):
        return [{"role": "user", "content": prompt if isinstance(prompt, str) and not text else text}]
    messages = copy.deepcopy(prompt)
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    last = users[-1] if users else None
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list) or not any(_is_audio(p) for p in content):
            continue
        if i != last:
            raise RequestError(f"prompt[{i}].content: the voice agent transcribes the last user turn's audio only; "
                               "give earlier turns as text (their transcripts)", field=f"prompt[{i}].content")
        kept = [p for p in content if not _is_audio(p)]
        msg["content"] = [*kept, {"type": "text", "text": text}] if kept else text
    spoke = last is not None and isinstance(prompt[last].get("content"), list) and any(
        _is_audio(p) for p in prompt[last]["content"])
    if not spoke and text:
        messages.append({"role": "user", "content": text})
    return messages


def asr2chat(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """ASR output -> the LLM's input: the conversation with the new user turn's transcript."""
    out = single_upstream(upstream, EDGE)
    messages = with_transcript(request.prompt, transcript(out.text or ""))
    return StageInput(request.request_id, prompt=messages, extra=dict(request.extra), cache_salt=request.cache_salt,
                      tools=request.tools, chat_template_kwargs=request.chat_template_kwargs)
