"""The voice a chat or realtime request names, as the stage that speaks takes it (`StageInput.extra`): one of the
pipeline's voices as `speaker` (after --voice-map), or an uploaded voice (POST /v1/audio/voices) as its clip and
transcript where a voice agent's speech stage clones voices from a request's own clip (PipelineInfo.clones_voices).

    {"speaker": "belinda"}                                              a voice of the pipeline's
    {"reference_text": "...", "reference_audio": MultiModalInput(...)}  an uploaded one: the clip rides to the
                                                                        speech stage (its edge makes it that
                                                                        stage's reference audio)

A text-to-speech entry stage takes an uploaded clip as its own prompt's audio (speech/serving.py); a thinker -> talker
pipeline speaks its talker's voices only.
"""
from __future__ import annotations

from typing import Any

from omni.messages import REFERENCE_AUDIO, MultiModalInput
from omni.serve.state import PipelineInfo
from omni.serve.voices.store import UploadedVoice, UploadedVoices

def speaks_uploaded(info: PipelineInfo) -> bool:
    """Whether the pipeline is a voice agent whose speech stage clones voices: a request may name an uploaded one."""
    return info.recognizer is not None and info.clones_voices


def uploaded_for_cascade(info: PipelineInfo, uploaded: UploadedVoices, voice: str | None) -> UploadedVoice | None:
    """The uploaded voice `voice` names, on a voice agent whose speech stage clones voices; else None."""
    return uploaded.get(voice) if voice is not None and speaks_uploaded(info) else None


def voice_extra(info: PipelineInfo, voice: str | None, uploaded: UploadedVoice | None) -> dict[str, Any]:
    """The request's `extra` for the voice (see the module docstring); {} when none is named."""
    if uploaded is not None:
        return {"reference_text": uploaded.text,
                REFERENCE_AUDIO: MultiModalInput("audio", uploaded.wave, sampling_rate=uploaded.rate)}
    return {"speaker": info.speaker(voice)} if voice else {}
