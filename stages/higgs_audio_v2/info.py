"""The facts of Higgs Audio v2's stage models (omni.stage_info.StageInfo), declared once: each class's `info` and
its registration (stages/__init__.py) name these objects. Torch-free: validating a config imports this module."""
from __future__ import annotations

from omni.stage_info import StageInfo

# Codec frames -> 24 kHz waveform in one call per request (no KV cache), its input taken in chunks on a
# streaming edge and decoded in windows as the frames arrive.
CODEC = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
