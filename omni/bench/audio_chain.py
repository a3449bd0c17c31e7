"""The thinker -> talker -> vocoder chain of an omni config, found from its edges (no stage names assumed).

Qwen2.5-Omni's vocoder stage is `token2wav`, Qwen3-Omni's `code2wav`; the benchmarks that time audio
(omni, streaming, capacity, qwen3-vs-hf) find the chain from the config instead: the audio stage is the
one whose final output is audio, the talker its only input, the thinker the talker's only input (a
stage with no inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AudioChain:
    thinker: str
    talker: str
    audio: str  # the stage whose final output is the waveform
    # whether the talker takes an image and an audio clip in one conversation (Qwen3-Omni's refuses them)
    mixed_media: bool = True

    @property
    def names(self) -> list[str]:
        return [self.thinker, self.talker, self.audio]

    def plain_edges(self) -> dict[str, Any]:
        """Stage overrides making both edges plain (non-streaming); the input processors stay."""
        return {self.talker: {"inputs": [self.thinker]}, self.audio: {"inputs": [self.talker]}}

    def media(self, rng: Any, kinds: list[str] | None = None) -> dict[str, Any]:
        """multi_modal_data for a first turn: `kinds` of an image and an audio clip (drawn from `rng`); by
        default both, or the image only where the talker refuses both in one conversation."""
        import numpy as np

        mm = {"image": rng.integers(0, 256, (112, 112, 3), dtype=np.uint8),
              "audio": ((0.1 * rng.standard_normal(32000)).astype(np.float32), 16000)}
        if kinds is None:
            kinds = list(mm) if self.mixed_media else ["image"]
        if not self.mixed_media and len(kinds) > 1:
            raise ValueError(f"media {'+'.join(kinds)}: the talker stage {self.talker!r} refuses an image and an "
                             "audio clip in one conversation; choose one")
        return {k: mm[k] for k in kinds}


def audio_chain(cfg: Any) -> AudioChain:
    """The chain of a PipelineConfig (or a config path): ValueError naming the stages when it is not
    exactly thinker -> talker -> audio stage."""
    if not hasattr(cfg, "stages"):
        from omni.config.loader import load_config

        cfg = load_config(cfg)
    audio = [s for s in cfg.stages if s.final_output == "audio"]
    if len(audio) != 1:
        raise ValueError(f"config {cfg.name!r}: expected exactly one stage with final_output: audio, got "
                         f"{[s.name for s in audio]}")

    def only_input(stage: Any, role: str) -> Any:
        edges = stage.input_edges
        if len(edges) != 1:
            raise ValueError(f"config {cfg.name!r}: the {role} stage {stage.name!r} must have exactly one input, "
                             f"got {[e.stage for e in edges]}")
        return cfg.stage(edges[0].stage)

    talker = only_input(audio[0], "audio")
    thinker = only_input(talker, "talker")
    if thinker.inputs:
        raise ValueError(f"config {cfg.name!r}: the thinker stage {thinker.name!r} must take no inputs, got "
                         f"{[e.stage for e in thinker.input_edges]}")
    if len(cfg.stages) != 3:
        raise ValueError(f"config {cfg.name!r}: expected the three stages {thinker.name} -> {talker.name} -> "
                         f"{audio[0].name}, got {[s.name for s in cfg.stages]}")
    from omni import registry

    mixed = bool(getattr(registry.resolve_stage_model(talker.model), "mixed_media", True))
    return AudioChain(thinker.name, talker.name, audio[0].name, mixed)
