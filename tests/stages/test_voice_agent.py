"""The voice agent of stage_configs/voice_agent_tiny.yaml through the Python API: recorded speech in -> Qwen3-ASR's
transcript -> SmolLM2's reply -> Higgs Audio v2 speaking it piece by piece in one request -> the codec's waveform.
Every word of the reply is spoken once, in order; the conversation's second turn hits the LLM's prefix cache; the
streamed audio is the one-shot audio's length."""
from __future__ import annotations

import re

import numpy as np
import pytest
import soundfile as sf
from transformers import AutoTokenizer

from omni import Omni
from omni.messages import StageDelta
from stages.checkpoints.builtin import builtin_path
from tests.serve.realtime_utils import speech_wav

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CONFIG = "stage_configs/voice_agent_tiny.yaml"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Always answer in exactly three short sentences."}
USER_TURN = re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S)


@pytest.fixture(scope="module")
def agent():
    with Omni(CONFIG, {"tts": {"sampling": {"max_tokens": 600}}}, backend="local") as o:
        yield o


@pytest.fixture(scope="module")
def clip():
    wave, rate = sf.read(speech_wav(), dtype="float32")
    return wave[: 2 * rate], rate


def _turn(history: list[dict], clip) -> dict:
    return {"prompt": [SYSTEM, *history, {"role": "user", "content": [{"type": "audio"}]}],
            "multi_modal_data": {"audio": clip}}


@pytest.fixture(scope="module")
def first(agent, clip):
    (out,) = agent.generate([_turn([], clip)])
    assert out.error is None, out.error
    return out


def test_a_spoken_turn_is_transcribed_answered_and_every_word_spoken_once(first):
    asr, llm, tts, codec = (first.outputs[s] for s in ("asr", "llm", "tts", "codec"))
    assert asr.text and llm.text and codec.audio is not None and codec.audio.size > 0
    tok = AutoTokenizer.from_pretrained(str(builtin_path("tiny-higgs-audio-v2")))
    spoken = USER_TURN.findall(tok.decode(list(tts.prompt_token_ids) + list(tts.token_ids)))
    assert len(spoken) >= 2  # the reply's sentences came as turns of the one TTS request
    assert " ".join(spoken).split() == llm.text.split()
    assert tts.token_ids.count(tok.convert_tokens_to_ids("<|audio_out_bos|>")) == len(spoken) - 1


def test_the_second_turn_hits_the_llms_prefix_cache(agent, clip, first):
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": first.outputs["llm"].text}]
    history[0]["content"] = first.outputs["asr"].text.split("<asr_text>")[-1].strip() or "hello"
    (out,) = agent.generate([_turn(history, clip)])
    assert out.error is None, out.error
    assert out.outputs["llm"].num_cached_tokens >= 16  # at least the system turn's blocks
    assert out.outputs["codec"].audio.size > 0


def test_streamed_audio_is_the_one_shot_audio(agent, clip, first):
    audio = [d.audio for d in agent.stream([_turn([], clip)])
             if isinstance(d, StageDelta) and d.stage == "codec" and d.audio is not None]
    assert len(audio) > 1  # in pieces, as the reply is spoken
    assert np.concatenate(audio).size == first.outputs["codec"].audio.size


def test_the_real_weights_config_validates_on_directories_as_transformers_saves_them(monkeypatch, capsys):
    from omni import cli

    monkeypatch.setenv("QWEN3_ASR_PATH", str(builtin_path("tiny-qwen3-asr")))
    monkeypatch.setenv("HIGGS_AUDIO_PATH", str(builtin_path("tiny-higgs-audio-v2")))
    assert cli.main(["validate", "stage_configs/voice_agent.yaml"]) == 0
    out = capsys.readouterr().out
    assert "llm: causal_lm (builtin:smollm2)  <- asr via qwen3_asr_to_chat" in out
    assert "tts: higgs_audio_v2" in out and "<- llm (streaming) via text_to_higgs_audio_v2" in out


def test_a_typed_turn_skips_the_ears_and_is_answered_aloud(agent):
    (out,) = agent.generate([{"prompt": [SYSTEM, {"role": "user", "content": "Tell me about the moon."}]}])
    assert out.error is None, out.error
    assert out.outputs["asr"].text == "" and out.outputs["asr"].token_ids == [151645]  # <|im_end|> at once
    assert "moon" in out.outputs["llm"].text.lower() and out.outputs["codec"].audio.size > 0
