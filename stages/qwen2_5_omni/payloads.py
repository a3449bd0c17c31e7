"""What Qwen2.5-Omni's input processors hand its models (stages/qwen2_5_omni/edges.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import EdgePayload

from stages.common.talker_feed import ThinkerReply


@dataclass(slots=True, kw_only=True)
class ThinkerToTalker(ThinkerReply):
    """thinker2talker: the talker's prompt is built from the thinker's rows and 3-D rotary positions."""

    hidden: np.ndarray  # [rows, hidden] float32: one row per token the thinker computed
    positions: np.ndarray  # [len(prompt_ids), 3]: the thinker prompt's rotary positions


@dataclass(slots=True)
class CodesToWave(EdgePayload):
    """talker2wav: token2wav's side input (the codec tokens are the prompt's token ids)."""

    speaker: str | None = None  # the caller's voice (None: the default speaker)
