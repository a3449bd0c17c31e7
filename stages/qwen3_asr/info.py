"""The facts of Qwen3-ASR's stage model (omni.stage_info.StageInfo), declared once: its class's `info` and its
registration (stages/__init__.py) name this object. Torch-free: validating a config imports this module."""
from __future__ import annotations

from omni.stage_info import StageInfo

# A speech recognizer rendering its own prompt: the clip(s) in, a text `prompt` as its context, the language forced by
# `mm_processor_kwargs.language`. Its reply is "language <Name><asr_text><transcript>" (the tag is the prompt's when
# the language is forced): the transcript follows the marker.
ASR = StageInfo(media=("audio",), transcribes_audio=True, transcript_marker="<asr_text>")
