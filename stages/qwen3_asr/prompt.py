"""Qwen3-ASR's prompt, as `Qwen3ASRProcessor.apply_transcription_request` builds it with the released chat template:

    <|im_start|>system\\n{context}<|im_end|>\\n
    <|im_start|>user\\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\\n     (one per clip)
    <|im_start|>assistant\\n[language {Name}<asr_text>]

A request holds one clip (`Qwen3ASRProcessor` takes one per conversation). Its `prompt` is the processor's `prompt`
(the context: hotwords, domain text), as text, or as chat messages whose system texts are the context and whose user
turn holds the clip's audio part (the template shows the model nothing else, so anything else is refused, naming
it). `mm_processor_kwargs.language` is the processor's
`language` (a code or a name of the languages the model was trained on, in any case): forced, the assistant turn
starts with the tag the model would write, and it writes only the transcript.

Each clip's <|audio_pad|> then repeats once per encoder row (stages/qwen3_asr/audio.py).
"""
from __future__ import annotations

import dataclasses

from typing import Any

from omni.errors import RequestError
from omni.messages import StageInput

MM_PROCESSOR_KEYS = ("language",)
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"


def forced_language(inp: StageInput) -> str | None:
    """The language name the request forces (the processor's resolve_language), or None; other
    mm_processor_kwargs are refused, naming them."""
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    kwargs = inp.mm_processor_kwargs or {}
    unknown = [k for k in kwargs if k not in MM_PROCESSOR_KEYS]
    if unknown:
        raise RequestError(f"mm_processor_kwargs.{unknown[0]}: not a setting of Qwen3-ASR's processor (it takes "
                           f"{', '.join(MM_PROCESSOR_KEYS)})", field=f"mm_processor_kwargs.{unknown[0]}")
    language = kwargs.get("language")
    if language is None:
        return None
    where = "mm_processor_kwargs.language"
    if isinstance(language, str):
        for code, name in LANGUAGE_CODE_TO_NAME.items():
            if language.lower() in (code, name.lower()):
                return name
    raise RequestError(f"{where}: {language!r} is not a language Qwen3-ASR transcribes; one of "
                       f"{', '.join(sorted(LANGUAGE_CODE_TO_NAME))} (or their names: English, Chinese, ...)",
                       field=where, code="unsupported_value")


def _context_and_clips(prompt: Any, num_clips: int) -> tuple[str, int]:
    """(the system turn's text, how many audio placeholders the user turn holds)."""
    if prompt is None or isinstance(prompt, str):
        return prompt or "", num_clips
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise RequestError("prompt: give the context as a string, or chat messages ({'role', 'content'})",
                           field="prompt")
    context, clips = "", 0
    for i, msg in enumerate(prompt):
        role, content = msg["role"], msg.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        for j, part in enumerate(parts):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            where = f"prompt[{i}].content[{j}]" if isinstance(content, list) else f"prompt[{i}].content"
            if role == "system" and kind == "text":
                context += str(part.get("text", ""))
            elif role == "user" and kind == "audio":
                clips += 1
            elif role == "user" and kind == "text" and not part.get("text"):
                continue
            else:
                raise RequestError(f"{where}: Qwen3-ASR's prompt holds the context (system text) and the clip (the "
                                   f"user's audio part); the {role} turn's {kind!r} part is never shown to the model "
                                   "(force the language with mm_processor_kwargs.language)", field=where)
    return context, clips or num_clips


def last_clip(inp: StageInput) -> StageInput | None:
    """A voice agent's turn as its ears take it: the last clip of the conversation (the user's new turn), no context;
    None when the last user turn has no audio (a typed turn: nothing to hear)."""
    if not inp.mm_inputs or not _last_user_speaks(inp.prompt):
        return None
    return dataclasses.replace(inp, prompt=None, prompt_token_ids=None, mm_inputs=list(inp.mm_inputs[-1:]))


def _last_user_speaks(prompt: Any) -> bool:
    """The prompt's last user turn holds an audio part (a prompt that is no conversation: its clips are the turn)."""
    if not isinstance(prompt, list):
        return True
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "audio" for p in content)


def render_prompt(inp: StageInput) -> str:
    """The prompt's text, with the clip's audio placeholder."""
    if len(inp.mm_inputs) != 1:
        where = "multi_modal_data.audio" + ("[1]" if inp.mm_inputs else "")
        raise RequestError(f"{where}: Qwen3-ASR transcribes one clip a request, as its processor takes it (got "
                           f"{len(inp.mm_inputs)})", field=where)
    context, clips = _context_and_clips(inp.prompt, 1)
    language = forced_language(inp)
    return (f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n{AUDIO_PLACEHOLDER * clips}<|im_end|>\n"
            "<|im_start|>assistant\n" + (f"language {language}<asr_text>" if language else ""))
