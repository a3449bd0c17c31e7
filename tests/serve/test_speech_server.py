"""`POST /v1/audio/speech` on the tiny Qwen2.5-Omni with the real `openai` client (`client.audio.speech`),
in this process: every response format, the streamed forms (pcm bytes as they come, SSE), the thinker's
reply forced to the input (the talker gets exactly those tokens' rows), and the errors naming their field."""
from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve.server_utils import OMNI, produced, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
TEXT = "Good morning, this is a test."


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--audio-chunk-ms", "5") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()


@pytest.fixture(scope="module")
def reference(client) -> tuple[np.ndarray, int]:
    """The WAV of TEXT: the samples every other format is compared with (greedy stages: deterministic)."""
    return _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav").content)


def test_wav_voices_the_input_through_the_forced_thinker(server, client, reference):
    samples, rate = reference
    assert rate == 24000 and samples.size > 0 and np.abs(samples).max() > 0  # a random tiny talker: short
    # What the talker was given: the thinker's reply is exactly the input's tokens + eos, with one hidden
    # row per token the thinker computed (prompt + reply, the reply's last token excepted).
    talker = server.omni._omni._backend.workers["talker"].engine.model
    thinker = server.omni._omni._backend.workers["thinker"].engine
    seen = []
    real = talker.add_request

    def spy(rid, prepared, inp):
        seen.append(inp.payload)
        return real(rid, prepared, inp)

    talker.add_request = spy
    try:
        again = client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav")
    finally:
        del talker.add_request
    (payload,) = seen
    forced = thinker.tokenizer.encode(TEXT, add_special_tokens=False) + [thinker.model.eos_token_id]
    assert payload.output_ids == forced
    assert payload.hidden.shape[0] == len(payload.prompt_ids) + len(forced) - 1
    assert payload.speaker == "Chelsie"
    np.testing.assert_array_equal(_wav(again.content)[0], samples)  # greedy: the same speech again
    wait_idle(server)


def test_pcm_flac_mp3_opus(client, reference):
    samples, rate = reference
    pcm = client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="pcm").content
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), samples)
    flac, flac_rate = sf.read(io.BytesIO(client.audio.speech.create(
        model=MODEL, input=TEXT, voice="Chelsie", response_format="flac").content), dtype="int16")
    assert flac_rate == rate
    np.testing.assert_array_equal(flac, samples)  # lossless, 16-bit like the WAV
    for fmt in ("mp3", "opus"):
        data = client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format=fmt).content
        decoded, _ = sf.read(io.BytesIO(data), dtype="float32")
        assert decoded.size > 0 and np.isfinite(decoded).all(), fmt
    # No response_format: OpenAI's default, mp3
    default = client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie")
    assert sf.info(io.BytesIO(default.content)).format == "MP3"


def test_streamed_pcm_arrives_in_chunks_and_equals_the_wav(client, reference):
    samples, _ = reference
    chunks = []
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Chelsie", response_format="pcm") as resp:
        assert resp.headers["content-type"] == "audio/pcm"
        for piece in resp.iter_bytes():
            chunks.append(piece)
    np.testing.assert_array_equal(np.frombuffer(b"".join(chunks), "<i2"), samples)


def test_sse_deltas_and_done_with_usage(server, client, reference):
    samples, _ = reference
    events = []
    with produced(server, "thinker") as thinker, produced(server, "talker") as talker, \
            client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Chelsie", response_format="pcm", stream_format="sse") as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), samples)
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # generated: the audio, the talker's codec tokens (OpenAI's speech output tokens are audio tokens); read: the
    # thinker's prompt and its reply forced to the input (the input's tokens and eos, nothing of it sampled)
    (codes,), (forced,) = talker.values(), thinker.values()
    assert usage["output_tokens"] == len(codes) > 0
    assert usage["input_tokens"] > len(forced) >= 5
    # SSE with a file format: the whole file in one delta
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Chelsie", response_format="wav", stream_format="sse") as resp:
        lines = [json.loads(x[5:]) for x in resp.iter_lines() if x.startswith("data:")]
    assert [e["type"] for e in lines] == ["speech.audio.delta", "speech.audio.done"]
    np.testing.assert_array_equal(_wav(base64.b64decode(lines[0]["audio"]))[0], samples)


def test_speed_changes_the_tempo_in_every_form(client, reference):
    """speed 2: half as many samples (the pitch is kept: tests/serve/audio/test_time_stretch.py), the same samples in
    the file, streamed as pcm and as SSE deltas."""
    samples, _ = reference
    fast, rate = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav",
                                                 speed=2.0).content)
    assert rate == 24000 and fast.size == round(samples.size / 2)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Chelsie", response_format="pcm", speed=2.0) as resp:
        np.testing.assert_array_equal(np.frombuffer(b"".join(resp.iter_bytes()), "<i2"), fast)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="Chelsie", response_format="pcm", speed=2.0, stream_format="sse") as resp:
        deltas = [json.loads(x[5:]) for x in resp.iter_lines() if x.startswith("data:")]
    audio = b"".join(base64.b64decode(d["audio"]) for d in deltas if d["type"] == "speech.audio.delta")
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), fast)
    slow, _ = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav",
                                              speed=0.5).content)
    assert slow.size == samples.size * 2
    same, _ = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav",
                                              speed=1.0).content)
    np.testing.assert_array_equal(same, samples)


def test_voice_as_an_id_object(client, reference):
    data = client.audio.speech.create(model=MODEL, input=TEXT, voice={"id": "Chelsie"}, response_format="wav").content
    np.testing.assert_array_equal(_wav(data)[0], reference[0])


def test_instructions_condition_the_voice(client, reference):
    """Instructions are the thinker's system turn: the talker hears other hidden states."""
    data = client.audio.speech.create(model=MODEL, input=TEXT, voice="Chelsie", response_format="wav",
                                      instructions="Speak slowly and warmly.").content
    samples, rate = _wav(data)
    assert rate == 24000 and samples.size > 0
    assert samples.size != reference[0].size or not np.array_equal(samples, reference[0])


@pytest.mark.parametrize("kw, param", [
    ({"voice": "alloy"}, "voice"),  # the talker knows Chelsie and Ethan
    ({"voice": "Chelsie", "response_format": "aac"}, "response_format"),
    ({"voice": "Chelsie", "speed": 5.0}, "speed"),  # OpenAI's range: 0.25-4.0
    ({"voice": "Chelsie", "input": ""}, "input"),
    ({"voice": "Chelsie", "input": "word " * 900}, "input"),  # too long a reply for the thinker's context
    ({"voice": "Chelsie", "model": "tts-1"}, "model"),
    ({"voice": {"id": "nobody"}}, "voice.id"),  # OpenAI's custom-voice form: the talker refuses the name
    ({"voice": {"name": "Chelsie"}}, "voice"),
])
def test_errors_name_the_field(server, client, kw, param):
    args = {"model": MODEL, "input": TEXT, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.audio.speech.create(**args)
    assert e.value.status_code in (400, 404), e.value
    assert e.value.body["param"] == param, e.value.body
    wait_idle(server)


def test_too_long_an_input_is_refused_in_the_endpoints_words(server, client):
    """The caller sent `input`, nothing else: the refusal speaks of it and of the room its voicing needs, never of a
    prompt or a max_tokens they did not send (it said `prompt: 1048 tokens + max_tokens 1001 = 2049 exceed ...`)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, input="1" * 1000, voice="Chelsie", response_format="wav")
    body = e.value.body
    assert (body["param"], body["code"]) == ("input", "context_length_exceeded"), body
    assert body["message"] == (  # the thinker's prompt holds the input, then its reply is the input again (+ eos)
        "input: too long to voice: the voiced reply needs 2049 tokens of the model's context (the prompt holding the "
        "input, then the input again as the reply spoken), more than the 2048 it holds (max_model_len of stage "
        "'thinker'); shorten input")
    wait_idle(server)


def test_an_input_past_4096_characters_is_shown_cut_with_its_quotes(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, input="a" * 4097, voice="Chelsie")
    body = e.value.body
    assert body["param"] == "input", body
    # cut short, and marked so, with both quotes: the shown value ends where the quote closes
    assert body["message"] == 'input: String should have at most 4096 characters (got "' + "a" * 57 + '…")'


def test_streamed_errors_before_audio_are_http_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        with client.audio.speech.with_streaming_response.create(
                model=MODEL, input=TEXT, voice="nobody", response_format="pcm", stream_format="sse"):
            pass
    assert e.value.body["param"] == "voice"


def test_streaming_edges_voice_the_forced_reply():
    """With the small config's streaming edges (thinker ~> talker one row per step, talker ~> token2wav in
    chunks), the forced reply reaches the talker as it does when generated: in one chunk, after the one
    prefill pass, rows and tokens together; the streamed pcm equals the WAV."""
    import json as _json

    from tests.serve.server_utils import REPO
    from tests.test_cli_streamed_audio import streaming_edges

    edges = _json.dumps(streaming_edges(REPO / "stage_configs" / "qwen2_5_omni_small.yaml"))
    with serve_in_process(OMNI, "--backend", "local", "--stage-overrides", edges) as s:
        client = s.client()
        talker = s.omni._omni._backend.workers["talker"].engine.model
        thinker = s.omni._omni._backend.workers["thinker"].engine
        seen, real = [], talker.add_request
        talker.add_request = lambda rid, prepared, inp: (seen.append(inp.payload), real(rid, prepared, inp))[1]
        try:
            wav, rate = _wav(client.audio.speech.create(model=MODEL, input=TEXT, voice="Ethan",
                                                        response_format="wav").content)
        finally:
            del talker.add_request
        assert rate == 24000 and wav.size > 0
        forced = thinker.tokenizer.encode(TEXT, add_special_tokens=False) + [thinker.model.eos_token_id]
        (payload,) = seen
        assert payload.output_ids == forced and not payload.streaming  # whole, in the first chunk
        assert payload.hidden.shape[0] == len(payload.prompt_ids) + len(forced) - 1
        with client.audio.speech.with_streaming_response.create(
                model=MODEL, input=TEXT, voice="Ethan", response_format="pcm") as resp:
            pcm = np.frombuffer(b"".join(resp.iter_bytes()), "<i2")
        np.testing.assert_array_equal(pcm, wav)
        assert thinker.stats().finished == 2
        wait_idle(s)
