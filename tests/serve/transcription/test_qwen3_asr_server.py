"""`/v1/audio/transcriptions` on a pipeline whose text stage is a speech recognizer (stage_configs/qwen3_asr_tiny.yaml)
with the real `openai` client, in this process, on recorded speech: the transcript is what transformers' Qwen3-ASR
generates for the clip, as Qwen3ASRProcessor's decode gives it (the language tag taken off), in every format
(json, text, streamed, verbose_json with the language); bad input is a 400 naming the field."""
from __future__ import annotations

import io

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve.realtime_utils import speech_wav
from tests.serve.server_utils import REPO, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
CONFIG = REPO / "stage_configs" / "qwen3_asr_tiny.yaml"
MODEL = "qwen3_asr_tiny"


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CONFIG, "--backend", "local") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _wav(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip() -> bytes:
    """The first 4 s of the recording, as a WAV."""
    x, rate = sf.read(str(speech_wav()), dtype="int16")
    return _wav(x[: 4 * rate])


def _expected(data: bytes, language: str | None = None, context: str | None = None) -> tuple[str, int]:
    """(transformers' transcript of the clip the server decodes, its reply's token count): greedy generate on the
    processor's inputs, as many tokens as the endpoint allows, decoded by the processor's transcription_only."""
    import torch
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration
    from transformers.models.qwen3_asr.processing_qwen3_asr import _detect_and_fix_repetitions

    from omni.registry import resolve_model_path
    from omni.serve.audio.codecs import decode_audio
    from omni.serve.generation.asr_job import max_tokens_for

    path = str(resolve_model_path("builtin:tiny-qwen3-asr"))
    processor = AutoProcessor.from_pretrained(path)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    wave, rate = decode_audio(data, "file", 1 << 30, 16000)
    inputs = processor.apply_transcription_request(wave, language=language, prompt=context)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        reply = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens_for(len(wave) / rate))[0, n:]
    raw = processor.decode(reply, skip_special_tokens=True)
    assert _detect_and_fix_repetitions(raw) == raw  # the original library's repetition fix (not applied) is idle
    return processor.decode(reply, return_format="transcription_only"), len(reply)


@pytest.mark.slow
def test_json_text_and_stream_are_transformers_transcript(server, client, clip):
    want, tokens = _expected(clip)
    got = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip))
    assert got.text == want and got.usage.output_tokens == tokens
    details = got.usage.input_token_details  # 4 s of audio: 52 encoder rows, the rest the chat turns
    assert details.audio_tokens == 52 and details.text_tokens == got.usage.input_tokens - 52
    assert client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip), response_format="text") == want
    events = list(client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip), stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == want
    wait_idle(server)


def test_language_and_prompt_are_the_recognizers_own(server, client, clip):
    """`language` forces the recognizer's language (its processor's option), `prompt` is its context; the second
    request with the same clip and context hits the first one's prefix cache."""
    want, _ = _expected(clip, "en", "Beckett, Godot")
    first = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip), language="en",
                                               prompt="Beckett, Godot")
    assert first.text == want
    asr = lambda: server.omni._omni.stats()["stages"]["asr"]  # noqa: E731
    before = asr()
    again = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip), language="en",
                                               prompt="Beckett, Godot")
    after = asr()
    assert again.text == want
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert after["encoder_runs"] == before["encoder_runs"]  # the clip's rows were never recomputed
    wait_idle(server)


def test_verbose_json_reports_the_segments_and_the_language(server, client, clip):
    verbose = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip), language="en",
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert verbose.language == "en" and verbose.segments
    assert verbose.text == " ".join(s.text for s in verbose.segments if s.text)
    assert all(s.tokens for s in verbose.segments)
    wait_idle(server)


@pytest.mark.parametrize("kwargs,param", [
    (dict(file=("clip.wav", b"RIFF not really a wav")), "file"),
    (dict(language="sw"), "language"),  # an ISO-639-1 code Qwen3-ASR was not trained on
])
def test_bad_input_is_a_400_naming_the_field(server, client, clip, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=MODEL, **{"file": ("clip.wav", clip), **kwargs})
    assert e.value.body["param"] == param
    wait_idle(server)


def test_a_recognizer_does_not_translate(server, client, clip):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.translations.create(model=MODEL, file=("clip.wav", clip))
    assert e.value.body["param"] == "model"
