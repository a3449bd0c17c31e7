"""A talker whose first token is its codec eos says nothing: the request still finishes, with no audio and no
error, on both omni pipelines, with and without streaming edges (the QA pass: a speech request got a 500 when
the random talker did so); the next request is voiced as before."""
from __future__ import annotations

from pathlib import Path

import pytest

from omni import Omni, StageDelta

CONFIGS = Path(__file__).resolve().parents[2] / "stage_configs"
STREAMED = {
    "qwen2_5_omni_tiny": {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
                          "token2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 4}],
                                        "model_kwargs": {"first_chunk_codes": 5, "chunk_codes": 8}}},
    "qwen3_omni_tiny": {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
                        "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}]}},
}
AUDIO_STAGE = {"qwen2_5_omni_tiny": "token2wav", "qwen3_omni_tiny": "code2wav"}


@pytest.mark.parametrize("streamed", [False, True], ids=["one-shot", "streamed"])
@pytest.mark.parametrize("name", ["qwen2_5_omni_tiny", "qwen3_omni_tiny"])
def test_a_talker_that_says_nothing_gives_no_audio_and_no_error(name, streamed):
    with Omni(str(CONFIGS / f"{name}.yaml"), backend="local",
              stage_overrides=STREAMED[name] if streamed else None) as o:
        eos = o._backend.workers["talker"].engine.model.eos_token_id
        audio_stage = AUDIO_STAGE[name]
        silent = {"talker": {"logit_bias": {eos: 100.0}}}
        finals, pieces = {}, []
        for ev in o.stream({"prompt": "Say something.", "request_id": "quiet"}, silent):
            if isinstance(ev, StageDelta):
                if ev.audio is not None:
                    pieces.append(ev.audio)
            else:
                finals[ev.stage] = ev
        audio = finals[audio_stage]
        assert audio.error is None and audio.finish_reason != "error", audio.error
        assert audio.audio is not None and len(audio.audio) == 0 and sum(len(p) for p in pieces) == 0
        assert finals["thinker"].text
        (voiced,) = o.generate(["Say something."], use_tqdm=False)
        assert len(voiced.outputs[audio_stage].audio) > 0
