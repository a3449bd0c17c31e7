"""What Qwen3-Omni's input processors hand its models (stages/qwen3_omni/edges.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import EdgePayload

from stages.common.talker_feed import ThinkerReply


@dataclass(slots=True, kw_only=True)
class ThinkerToTalker(ThinkerReply):
    """qwen3_omni_thinker2talker: the talker's prompt is built from the thinker's per-token rows."""

    embeds: np.ndarray  # [rows, hidden] float32: the thinker's input embeddings
    accept_hidden: np.ndarray  # [rows, hidden] float32: its hidden states at talker_config.accept_hidden_layer
    mm_meta: np.ndarray | None = None  # [rows, k] float32: image rows' metadata (prompts with images)


@dataclass(slots=True)
class FramesToWave(EdgePayload):
    """qwen3_omni_talker2code2wav: code2wav's codec frames (prompt_token_ids carries their first codebook)."""

    codes: np.ndarray  # [frames, num_code_groups] int64
