"""The facts of Qwen2.5-Omni's stage models (omni.stage_info.StageInfo), declared once: each class's `info` and
its registration (stages/__init__.py) name these objects. Torch-free: validating a config imports this module.

The thinker renders its own prompt, without tools (a request with tools is refused)."""
from __future__ import annotations

from omni.stage_info import StageInfo

# Text, images and audio in (its preprocess renders them into Qwen2.5-Omni's chat format; no video yet).
THINKER = StageInfo(media=("image", "audio"))
# Consumes one thinker row per step (compute_limit says how far); reply row k is the thinker's hidden state of
# token k, which exists once token k + 1 is sampled, so a reply of one token has no row (preprocess refuses it;
# `omni serve` voices such a reply by forcing its text and eos: Omni.min_spoken_tokens). Its voices come from
# the checkpoint's speakers (the loaded talker fills them in).
TALKER = StageInfo(decodes_before_input_complete=True, min_upstream_tokens=2)
# Codec tokens -> waveform in one call per request (no KV cache), its input taken in chunks on a streaming edge.
TOKEN2WAV = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
