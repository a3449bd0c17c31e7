"""The tiny Higgs Audio v2 pipeline (LLM -> codec) through the Python API: greedy audio equals transformers'
`generate` + the audio tokenizer's decode (the codec's weights, decoded as transformers decodes), streamed or not,
with prefix caching on and off; a voice cloned from real recorded speech is encoded once and its blocks reused; the
Python API's per-request reference clip is the same voice as a named one; the same audio on Ray."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from omni import Omni
from omni.messages import StageDelta, StageInput, StageOutput
from stages.checkpoints.builtin import builtin_path
from stages.higgs_audio_v2.codec_model import HiggsCodec
from stages.higgs_audio_v2.delay import revert_delay_pattern
from tests.serve.realtime_utils import speech_wav
from tests.stages.higgs_audio_v2.higgs_utils import VOICE_TEXT, hf_frames

pytestmark = pytest.mark.timeout(600)
CONFIG = "stage_configs/higgs_audio_v2_tiny.yaml"
TEXTS = ["Please water the plants before you leave.", "Our train was delayed by twenty minutes."]  # 40+ frames
STREAMED_SNR_DB = 60.0  # the streamed windows' bound against the one-shot decode (codec.py)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """3 s of real recorded speech (16 kHz), as a voice's WAV."""
    wave, rate = sf.read(speech_wav(), dtype="float32")
    path = tmp_path_factory.mktemp("voice") / "beckett.wav"
    sf.write(path, wave[: 3 * rate], rate)
    return path, wave[: 3 * rate], rate


def _overrides(clip_path, caching=True, streamed=True):
    ov = {"tts": {"enable_prefix_caching": caching, "sampling": {"temperature": 0.0, "max_tokens": 64},
                  "model_kwargs": {"voices": {"beckett": {"audio": str(clip_path), "text": VOICE_TEXT}}}}}
    if not streamed:
        ov["codec"] = {"inputs": ["tts"]}
    return ov


@pytest.fixture(scope="module")
def reference(clip):
    """transformers' side: the model's generate on omni's prompt ids, the voice encoded by the same codec, the
    frames decoded with the codec's one-shot decode (what HiggsAudioV2Processor.batch_decode does)."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    from stages.common.resample import resample

    path = builtin_path("tiny-higgs-audio-v2")
    hf = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    codec = HiggsCodec.from_pretrained(path / "audio_tokenizer")
    _, wave, rate = clip
    with torch.inference_mode():
        voice = codec.encode(resample(torch.from_numpy(wave), rate, codec.sample_rate)[None, None])[0].numpy()
    with Omni(CONFIG, _overrides(clip[0]), backend="local") as o:
        out = {}
        for text in TEXTS:
            ids = o.tokenize(StageInput("t", prompt=text, extra={"speaker": "beckett"}))["tokens"]
            frames = hf_frames(hf, None, text, voice, max_tokens=64, prompt_ids=ids)
            bos = hf.config.audio_stream_bos_id
            start = np.flatnonzero((frames == bos).all(axis=1))[-1]
            ends = np.flatnonzero((frames[start:] == bos + 1).all(axis=1))
            body = frames[start + 1: start + ends[0] if len(ends) else len(frames)]
            codes = np.clip(revert_delay_pattern(body), 0, bos - 1)
            with torch.inference_mode():
                out[text] = codec.decode(torch.from_numpy(codes.T.copy())[None])[0, 0].numpy()
    return out


def _speak(omni, texts, voice="beckett"):
    outs = omni.generate([{"prompt": t, "voice": voice} for t in texts])
    return [np.asarray(o.outputs["codec"].audio, np.float32) for o in outs]


AGREE_DB = 80.0  # the random codec's deep decoder amplifies fp32 rounding: 97-110 dB between batch shapes


def _agrees(audio: np.ndarray, want: np.ndarray) -> None:
    """The same waveform up to the blocking of fp32 sums (the codec's convolutions in other batch shapes and thread
    counts): one differing code of one frame puts it below 20 dB."""
    from omni.bench.measures import snr_db

    assert len(audio) == len(want) and snr_db(want, audio) >= AGREE_DB


@pytest.mark.parametrize("caching", [True, False])
def test_one_shot_audio_equals_transformers(clip, reference, caching):
    with Omni(CONFIG, _overrides(clip[0], caching=caching, streamed=False), backend="local") as o:
        for text, audio in zip(TEXTS, _speak(o, TEXTS)):
            _agrees(audio, reference[text])


def test_streamed_audio_has_the_one_shot_length_and_agrees(clip, reference):
    from omni.bench.measures import snr_db

    with Omni(CONFIG, _overrides(clip[0]), backend="local") as o:
        events = list(o.stream([{"prompt": TEXTS[0], "voice": "beckett"}]))
    chunks = [e.audio for e in events if isinstance(e, StageDelta) and e.stage == "codec" and e.audio is not None]
    final = next(e for e in events if isinstance(e, StageOutput) and e.stage == "codec")
    want = reference[TEXTS[0]]
    assert len(chunks) > 1 and sum(len(c) for c in chunks) == len(final.audio) == len(want)
    assert snr_db(want, np.concatenate(chunks)) >= STREAMED_SNR_DB


def test_a_voice_is_encoded_once_and_its_blocks_reused(clip):
    with Omni(CONFIG, _overrides(clip[0]), backend="local") as o:
        _speak(o, TEXTS[:1])
        before = o.stats()["stages"]["tts"]
        _speak(o, TEXTS[1:])
        after = o.stats()["stages"]["tts"]
    assert after["encoder_runs"] == 1 and after["encoder_cache_hits"] == 0  # the named voice: codes kept
    reused = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert reused >= 3 * 25 - 16  # the 3 s reference (25 frames a second at the least) minus a partial block


def test_a_per_request_reference_clip_is_the_named_voice(clip):
    _, wave, rate = clip
    with Omni(CONFIG, _overrides(clip[0]), backend="local") as o:
        named = _speak(o, TEXTS[:1])[0]
        outs = o.generate([{"prompt": TEXTS[0], "voice": {"audio": (wave, rate), "text": VOICE_TEXT}}] * 2)
        cloned = [np.asarray(x.outputs["codec"].audio) for x in outs]
        stats = o.stats()["stages"]["tts"]
    _agrees(cloned[0], named)  # the two decode as one batch: other shapes of the same sums
    _agrees(cloned[1], named)
    assert stats["encoder_cache_hits"] >= 1  # the same clip sent twice: encoded once


def test_ray_backend_speaks_the_same_audio(clip, reference, ray_cluster):
    with Omni(CONFIG, _overrides(clip[0], streamed=False), backend="ray") as o:
        (audio,) = _speak(o, TEXTS[:1])
    _agrees(audio, reference[TEXTS[0]])
