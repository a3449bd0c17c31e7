"""`omni_stream_format: "vllm-omni"` on the tiny Qwen2.5-Omni: the streamed chat vLLM-Omni's own server sends, read
the way vLLM-Omni's clients read it. Every chunk has a top-level `modality` ("text" / "audio"); an audio chunk's
`delta` is `{"role": "assistant", "content": <base64>}`, the piece as an audio file of its own in the request's
`audio.format` (wav by default), which the client decodes chunk by chunk (libsndfile: soundfile, or librosa /
vLLM's AudioMediaIO on top of it); pcm16 is raw samples, as vLLM-Omni sends it. Streamed audio is cut into 5 ms
chunks here (the tiny model speaks for a few tens of ms)."""
from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from omni.serve.audio.formats import encodable
from tests.serve.server_utils import OMNI, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
VLLM = {"omni_stream_format": "vllm-omni"}
CHUNK_MS = 5
MAGIC = {"wav": (b"RIFF",), "flac": (b"fLaC",), "mp3": (b"ID3", b"\xff"), "opus": (b"OggS",)}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--audio-chunk-ms", str(CHUNK_MS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def vllm_stream(client: Any, **kw: Any) -> tuple[list[str], str, list[bytes]]:
    """(each chunk's modality, the text, each audio chunk's bytes) of a vLLM-Omni-format stream, read as its
    clients read it: `chunk.modality` says what `choices[0].delta.content` holds."""
    modalities, text, audio = [], "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, extra_body=VLLM, **kw):
        modality = chunk.model_extra.get("modality")
        modalities.append(modality)
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if modality == "audio":
            assert delta.role == "assistant" and delta.audio is None
            audio.append(base64.b64decode(delta.content))
        else:
            text += delta.content or ""
    return modalities, text, audio


def decoded(data: bytes, dtype: str = "int16") -> tuple[np.ndarray, int]:
    """An audio chunk decoded as vLLM-Omni's client decodes it: a file libsndfile reads by itself."""
    return sf.read(io.BytesIO(data), dtype=dtype)


def reply(client: Any, fmt: str) -> Any:
    return client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": fmt}).choices[0].message


def test_each_audio_chunk_is_a_wav_file_by_default(server, client):
    """No `audio` parameter (vLLM-Omni's examples send none): wav. Every audio chunk decodes by itself as a WAV at
    the pipeline's rate, and the chunks' samples add up to exactly the non-streamed reply's WAV; the text chunks
    (modality "text", the role chunk first) add up to its text."""
    modalities, text, audio = vllm_stream(client, modalities=["text", "audio"])
    assert modalities[0] == "text" and set(modalities) == {"text", "audio"}, modalities
    assert len(audio) >= 2 and all(a.startswith(b"RIFF") for a in audio)
    pieces = [decoded(a) for a in audio]
    assert {rate for _, rate in pieces} == {24000}
    assert all(x.size == 24000 * CHUNK_MS // 1000 for x, _ in pieces[:-1])  # one 5 ms piece each
    ref = reply(client, "wav")
    samples, rate = decoded(base64.b64decode(ref.audio.data))
    assert rate == 24000 and samples.size > 0 and np.abs(samples).max() > 0
    np.testing.assert_array_equal(np.concatenate([x for x, _ in pieces]), samples)
    assert text and text == ref.content
    wait_idle(server)


@pytest.mark.parametrize("fmt", [f for f in ("flac", "mp3", "opus") if f in encodable()])
def test_each_audio_chunk_is_a_file_of_the_requested_format(server, client, fmt):
    """`audio.format` flac / mp3 / opus (vLLM-Omni's chat formats besides wav and pcm): every audio chunk is a file of
    that format by itself. FLAC is lossless: its chunks add up to exactly the WAV's samples; mp3 and opus decode to
    about one chunk's length each."""
    _, text, audio = vllm_stream(client, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": fmt})
    assert len(audio) >= 2 and all(a.startswith(MAGIC[fmt]) for a in audio), [a[:8] for a in audio]
    ref = reply(client, "wav")
    samples, rate = decoded(base64.b64decode(ref.audio.data))
    assert text == ref.content
    if fmt == "flac":
        np.testing.assert_array_equal(np.concatenate([decoded(a)[0] for a in audio]), samples)
    else:
        seconds = []
        for a in audio:
            x, r = decoded(a, "float32")
            assert r == rate and x.size > 0, (fmt, r, x.size)
            seconds.append(x.size / r)
        assert all(s >= CHUNK_MS / 1000 * 0.9 for s in seconds[:-1]), (fmt, seconds)
        assert samples.size / rate * 0.95 <= sum(seconds) <= samples.size / rate + 0.1 * len(seconds), fmt
    wait_idle(server)


def test_pcm16_chunks_are_raw_samples(server, client):
    """`audio.format` pcm16: raw 16-bit samples per chunk, no header (vLLM-Omni sends its pcm so too), adding up to
    the non-streamed pcm16 reply."""
    modalities, text, audio = vllm_stream(client, modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": "pcm16"})
    assert set(modalities) == {"text", "audio"} and audio
    ref = reply(client, "pcm16")
    assert text == ref.content and b"".join(audio) == base64.b64decode(ref.audio.data)
    wait_idle(server)

