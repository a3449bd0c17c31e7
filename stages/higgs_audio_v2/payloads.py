"""What Higgs Audio v2's input processors hand its models (stages/higgs_audio_v2/edges.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import EdgePayload


@dataclass(slots=True)
class CodesToWave(EdgePayload):
    """The codec's side input: audio frames as the LLM generated them, the delay pattern already undone and
    each code clipped to the codebook (as transformers' processor does before its audio tokenizer's decode).
    On a streaming edge each chunk carries the frames that arrived since the last one."""

    codes: np.ndarray  # [frames, num_codebooks] int64


@dataclass(slots=True)
class SpeakNext(EdgePayload):
    """The model's side input on a text edge (an LLM's reply spoken as it streams): the next piece of text to speak in
    the same request, after the audio of the pieces before it (a new user turn of the conversation)."""

    text: str
