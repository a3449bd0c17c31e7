"""What Higgs Audio v2's input processors hand its models (stages/higgs_audio_v2/edges.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import EdgePayload


@dataclass(slots=True)
class CodesToWave(EdgePayload):
    """higgs_audio_v2_to_codec: the codec's frames, aligned (the delay pattern undone) and clipped to the codebook
    (prompt_token_ids carries their first codebook for the engine's bookkeeping)."""

    codes: np.ndarray  # [frames, num_codebooks] int64
