"""`POST /v1/audio/speech` on a text-to-speech pipeline (the tiny Higgs Audio v2: the entry stage speaks its prompt)
with the real `openai` client, in this process: voices cloned from `--voice-dir` (real recorded speech), the input
spoken as it is (no forced reply), `instructions` as the scene, streamed pcm and SSE with the usage, the voices
listed, and the errors naming their field."""
from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve.realtime_utils import speech_wav
from tests.serve.server_utils import delete_voice, serve_in_process, upload_voice, wait_idle

pytestmark = pytest.mark.timeout(300)
CONFIG = "stage_configs/higgs_audio_v2_tiny.yaml"
MODEL = "higgs_audio_v2_tiny"
TEXT = "Please water the plants before you leave."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    wave_, rate = sf.read(speech_wav(), dtype="float32")
    sf.write(voices / "Beckett.wav", wave_[: 3 * rate], rate)
    (voices / "Beckett.txt").write_text("Hello there, this is how my voice sounds.\n")
    sf.write(voices / "second.wav", wave_[3 * rate: 5 * rate], rate)
    (voices / "second.txt").write_text("And this is another voice.\n")
    with serve_in_process(CONFIG, "--backend", "local", "--audio-chunk-ms", "5", "--voice-dir", str(voices)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _wav(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == 24000
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


@pytest.fixture(scope="module")
def reference(client) -> np.ndarray:
    return _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Beckett", response_format="wav").content)


def test_the_voice_dir_voices_are_listed_and_spoken(server, client, reference):
    assert server.get("/v1/audio/voices")[2]["voices"] == ["Beckett", "second"]
    assert reference.size > 0 and np.abs(reference).max() > 0
    again = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="beckett", response_format="wav").content)
    np.testing.assert_array_equal(again, reference)  # greedy, matched case-insensitively
    other = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="second", response_format="wav").content)
    assert not np.array_equal(other, reference)  # another reference clip: another voice
    stats = server.omni._omni.stats()["stages"]["tts"]
    assert stats["encoder_runs"] == 2  # each voice's clip encoded once
    assert stats["prefix_cache_hits"] > 0  # the second request in Beckett's voice reused its reference
    wait_idle(server)


def test_instructions_are_the_scene(client, reference):
    scened = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Beckett", response_format="wav",
                                             instructions="Audio is recorded from a quiet room.").content)
    assert not np.array_equal(scened, reference)


def test_streamed_pcm_and_sse_with_the_usage(server, client, reference):
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Beckett", response_format="pcm") as resp:
        pcm = b"".join(resp.iter_bytes())
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), reference)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Beckett", response_format="pcm", stream_format="sse") as resp:
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    np.testing.assert_array_equal(np.frombuffer(b"".join(base64.b64decode(d["audio"]) for d in deltas), "<i2"),
                                  reference)
    usage = events[-1]["usage"]
    tokens = server.omni._omni.tokenize({"prompt": TEXT, "voice": "Beckett"})["tokens"]
    assert usage["input_tokens"] == len(tokens)  # the prompt: the voice's reference turn and the input
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_an_unknown_voice_is_a_400_naming_the_voices(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, input=TEXT, voice="alloy")
    body = e.value.body
    assert body["param"] == "voice" and "Beckett" in body["message"]


def test_an_uploaded_voice_is_cloned_as_a_configured_one_and_can_be_deleted(server, client, reference, tmp_path):
    wave_, rate = sf.read(speech_wav(), dtype="float32")
    sf.write(tmp_path / "clip.wav", wave_[: 3 * rate], rate)  # the clip and transcript of the Beckett voice
    clip = (tmp_path / "clip.wav").read_bytes()
    status, body = upload_voice(server, "mine", clip, "Hello there, this is how my voice sounds.")
    assert status == 200 and body["success"] and body["voice"]["name"] == "mine"
    assert body["voice"]["duration_s"] == 3.0 and body["voice"]["consent"] == "recorded-with-consent"
    listed = server.get("/v1/audio/voices")[2]
    assert listed["voices"] == ["Beckett", "second", "mine"] and [v["name"] for v in listed["uploaded"]] == ["mine"]
    for voice in ("mine", {"id": "Mine"}):
        got = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice=voice, response_format="wav").content)
        np.testing.assert_array_equal(got, reference)  # the same clip and transcript: the same voice
    assert delete_voice(server, "mine") == (200, {"success": True, "message": "voice 'mine' deleted"})
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.audio.speech.create(model=MODEL, input=TEXT, voice="mine")
    status, body = delete_voice(server, "mine")
    assert status == 404 and body["error"]["param"] == "name"
    wait_idle(server)


@pytest.mark.parametrize("name, text, with_clip, status, param", [
    ("Beckett", "words", True, 409, "name"),  # a voice of the config
    ("bad name!", "words", True, 400, "name"),
    ("ok", None, True, 400, "ref_text"),  # the transcript the model clones from
    ("ok", "words", False, 400, "audio_sample"),
])
def test_uploads_that_cannot_be_kept_name_their_field(server, tmp_path, name, text, with_clip, status, param):
    wave_, rate = sf.read(speech_wav(), dtype="float32")
    sf.write(tmp_path / "clip.wav", wave_[: rate], rate)
    got, body = upload_voice(server, name, (tmp_path / "clip.wav").read_bytes() if with_clip else None, text)
    assert got == status and body["error"]["param"] == param, body
