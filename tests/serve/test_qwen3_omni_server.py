"""`omni serve stage_configs/qwen3_omni_tiny.yaml` with the real `openai` client (in this process, local backend):
text and audio out, non-streamed and SSE (the pcm16 chunks are the WAV's samples), image and audio in, an
unknown voice refused naming `audio.voice`."""
from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from tests.serve.server_utils import REPO, serve_in_process, wait_idle
from tests.serve.test_omni_server import png_url, stereo_wav_b64

pytestmark = pytest.mark.timeout(300)
CONFIG = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"
MODEL = "qwen3_omni_tiny"
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
AUDIO_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
PCM_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"}}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CONFIG, "--backend", "local", "--audio-chunk-ms", "20") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_audio_reply_wav_and_streamed_pcm16_agree(server, client):
    msg = client.chat.completions.create(model=MODEL, messages=HELLO, **AUDIO_OUT).choices[0].message
    assert msg.content and msg.audio.transcript == msg.content
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert samples.size > 0 and np.abs(samples).max() > 0
    text, chunks = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **PCM_OUT):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            chunks.append(np.frombuffer(base64.b64decode(delta.audio.data), "<i2"))
    assert text == msg.content and len(chunks) >= 2
    np.testing.assert_array_equal(np.concatenate(chunks), samples)
    wait_idle(server)


def test_image_and_audio_inputs_and_voice_errors(client):
    text_only = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe."}],
                                               max_tokens=4)
    for part, tokens in (({"type": "image_url", "image_url": {"url": png_url()}}, 6),  # 56x84 -> 64x96: 2x3 merged
                         ({"type": "input_audio", "input_audio": {"data": stereo_wav_b64(), "format": "wav"}}, 13)):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            part, {"type": "text", "text": "Describe."}]}], **AUDIO_OUT)
        assert r.choices[0].message.content and r.choices[0].message.audio.data
        # the placeholders (1 s of audio -> 13 encoder rows) + their start/end tokens
        assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + tokens + 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    assert e.value.body["param"] == "audio.voice", e.value.body
