"""The facts of Higgs Audio v2's stage models (omni.stage_info.StageInfo), declared once: each class's `info` and its
registration (stages/__init__.py) name these objects. Torch-free: validating a config imports this module."""
from __future__ import annotations

from omni.stage_info import StageInfo

# Renders its own prompt (the checkpoint's chat template) from text or chat messages; audio in as reference voices.
# Its voices are the named reference clips its config gives (the loaded model fills them in).
# Fed an LLM's reply piece by piece (a text edge), it speaks each piece as a new turn of the same request after the
# audio of the last: it samples while its input streams in, and its input goes on after its outputs.
MODEL = StageInfo(media=("audio",), speaks_prompt=True, decodes_before_input_complete=True,
                  takes_input_after_output=True)
# Codec frames -> 24 kHz waveform, one call per request (no KV cache), its input taken in chunks on a streaming edge.
CODEC = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
