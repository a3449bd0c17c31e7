"""The facts of Qwen3-Omni's stage models (omni.stage_info.StageInfo), declared once: each class's `info` and its
registration (stages/__init__.py) name these objects. Torch-free: validating a config imports this module."""
from __future__ import annotations

from omni.stage_info import StageInfo

# Renders its own prompt in Qwen3's function-calling format (stages/qwen3_omni/inputs.py render_chatml): a
# request's tools reach the model. Text, images and audio in (no video yet).
THINKER = StageInfo(renders_tools=True, media=("image", "audio"))
# Consumes one trailing thinker row per step (compute_limit says how far); as transformers builds the talker's
# prompt, the row of the thinker's last token is never used, so a reply of one token has none to voice
# (preprocess refuses it; `omni serve` voices it by forcing its text and eos: Omni.min_spoken_tokens). Its voices
# come from the checkpoint's speaker ids (the loaded talker fills them in).
TALKER = StageInfo(decodes_before_input_complete=True, min_upstream_tokens=2)
# Codec frames -> waveform in one call per request (no KV cache), its input taken in chunks on a streaming edge.
CODE2WAV = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
