"""Speech to text on an omni pipeline: the text stage (a thinker that hears audio) asked to write down, or
translate, a clip. Used by `/v1/audio/transcriptions`, `/v1/audio/translations` (transcription/serving.py) and the
Realtime sessions' input transcription (realtime/transcription.py).

A request of its own: a system turn saying what the model is, the clip, and the instruction (Qwen2.5-Omni's and
Qwen3-Omni's speech recognition prompts), text only, greedy unless the caller gives a temperature. A pipeline whose
entry stage is a speech recognizer (StageInfo.transcribes_audio: Qwen3-ASR) gets its own request instead: the clip,
the request's prompt as the recognizer's context and its language as the recognizer's (recognizer_prompt); its reply
leads with a language tag the endpoints take off (generation/transcript.py).

The token bound is generous for speech (~3 words, ~4 tokens a second): it only stops a model that does not stop.
"""
from __future__ import annotations

import math
import uuid
from typing import Any

import numpy as np

from omni.messages import MultiModalInput, StageInput
from omni.serve.audio.codecs import clips
from omni.serve.generation.job import Job
from omni.serve.http.errors import bad_request

ASR_SYSTEM = "You are a speech recognition model."
TASKS = {"transcribe": "Transcribe the audio into text.", "translate": "Translate the audio into English text."}
TOKENS_PER_SECOND, MIN_TOKENS = 12, 32


def instruction(task: str, language: str | None, prompt: str | None) -> str:
    text = TASKS[task]
    if language:
        text += f" The speech is in the language whose ISO-639-1 code is {language}."
    if prompt:
        text += f" Context: {prompt}"
    return text


def max_tokens_for(seconds: float) -> int:
    return max(MIN_TOKENS, math.ceil(seconds * TOKENS_PER_SECOND))


def asr_job(info: Any, wave: np.ndarray, rate: int, *, task: str = "transcribe", language: str | None = None,
            prompt: str | None = None, temperature: float = 0.0, fields: dict[str, str] | None = None,
            logprobs: bool = False, request_id: str | None = None) -> Job:
    """The clip (mono float32 at `rate`, the model's input rate) as one text-only request to the text stage;
    `logprobs`: each reply token's log-probability comes back (Run.logprobs)."""
    stage = info.text_stage or info.entry_stage
    if info.transcribes_audio:
        prompt_input, stage = recognizer_prompt(info, wave, rate, task, language, prompt), info.entry_stage
    else:
        # a clip longer than the encoder's window is heard as consecutive clips of it, in one request
        parts = clips(wave, rate)
        messages = [{"role": "system", "content": ASR_SYSTEM},
                    {"role": "user", "content": [*({"type": "audio"} for _ in parts),
                                                 {"type": "text", "text": instruction(task, language, prompt)}]}]
        media = [MultiModalInput("audio", part, sampling_rate=rate) for part in parts]
        prompt_input = StageInput("", prompt=messages, mm_inputs=media)
    # the token bound is a bound only: a long clip whose prompt fits the context is transcribed (max_tokens_fit)
    sampling: dict[str, Any] = {"temperature": float(temperature), "max_tokens": max_tokens_for(len(wave) / rate),
                                "max_tokens_fit": True}
    if logprobs:
        sampling["logprobs"] = 0  # the sampled token's own, no alternatives
    return Job(request_id or f"{task}-{uuid.uuid4().hex[:16]}", prompt_input, {stage: sampling}, stage, None, stage,
               [], dict(fields or {}))


def recognizer_prompt(info: Any, wave: np.ndarray, rate: int, task: str, language: str | None,
                      prompt: str | None) -> StageInput:
    """A speech recognizer's own request (StageInfo.transcribes_audio): the whole clip (it hears any length its
    positions hold), the request's prompt as its context, the language as its processor's `language`."""
    if task != "transcribe":
        raise bad_request(f"model: pipeline {info.model!r} transcribes speech with a speech-recognition model, which "
                          "does not translate; use /v1/audio/transcriptions", "model", "unsupported_value")
    return StageInput("", prompt=prompt or None, mm_inputs=[MultiModalInput("audio", wave, sampling_rate=rate)],
                      mm_processor_kwargs={"language": language} if language else None)


def asr_usage(run: Any) -> dict[str, Any]:
    """OpenAI's token usage of a transcription (its input: the clip's tokens and the instruction's)."""
    audio = run.prompt_mm_tokens.get("audio", 0)  # the clip's placeholder tokens; the rest is the instruction
    return {"type": "tokens", "total_tokens": run.prompt_tokens + run.completion_tokens,
            "input_tokens": run.prompt_tokens, "output_tokens": run.completion_tokens,
            "input_token_details": {"text_tokens": run.prompt_tokens - audio, "audio_tokens": audio}}
