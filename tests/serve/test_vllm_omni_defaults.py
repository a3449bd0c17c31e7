"""Coming from vLLM-Omni (request shapes from its public examples and tests, not its code), on the tiny Qwen2.5-Omni in
this process: `--default-modalities text,audio` answers a chat without `modalities` with text and audio (vLLM-Omni's
default; OpenAI's, text, stays the default); `--voice-map` lets OpenAI's voice names (alloy, ...) name the pipeline's
speakers on chat, speech and realtime, and without it such a name is refused saying how to turn it on; vLLM-Omni's
top-level `speaker` is an alias of `audio.voice`; `GET /v1/audio/voices` lists the voices."""
from __future__ import annotations

import base64

import pytest

from omni import cli
from omni.errors import ConfigError
from omni.serve.state import PipelineInfo, checked_voice_map
from tests.serve.realtime_utils import ran_to_its_end, until
from tests.serve.server_utils import CHAIN, OMNI, serve_in_process, wait_idle
from tests.serve.test_omni_server import wav_samples

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--default-modalities", "text,audio",
                          "--voice-map", "alloy=Chelsie,Echo=Ethan") as s:
        yield s


def _speech(reply) -> int:
    return wav_samples(base64.b64decode(reply.choices[0].message.audio.data))[0].size


def test_no_modalities_is_text_and_audio_on_a_server_that_says_so(server):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert reply.choices[0].message.content and _speech(reply) > 0
    # audio options without modalities are the default's, not a 400; an explicit ["text"] is still text only
    with_voice = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                                audio={"voice": "Ethan", "format": "wav"})
    assert _speech(with_voice) > 0
    text = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text"])
    assert text.choices[0].message.audio is None
    wait_idle(server)


def test_openai_voice_names_map_to_the_pipelines_speakers(server):
    client = server.client()
    mapped = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                            audio={"voice": "alloy", "format": "wav"})
    direct = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                            audio={"voice": "Chelsie", "format": "wav"})
    assert mapped.choices[0].message.audio.data == direct.choices[0].message.audio.data
    echo = client.audio.speech.create(model=MODEL, voice="echo", input="Hi there", response_format="wav").content
    ethan = client.audio.speech.create(model=MODEL, voice="Ethan", input="Hi there", response_format="wav").content
    assert echo == ethan
    status, _, body = server.get("/v1/audio/voices")
    assert status == 200 and body == {"voices": ["Chelsie", "Ethan"], "voice_map": {"alloy": "Chelsie",
                                                                                   "echo": "Ethan"}}
    wait_idle(server)


def test_the_speaker_field_is_an_alias_of_audio_voice(server):
    client = server.client()
    by_speaker = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                                extra_body={"speaker": "Ethan"})
    by_voice = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                              audio={"voice": "Ethan", "format": "wav"})
    assert by_speaker.choices[0].message.audio.data == by_voice.choices[0].message.audio.data
    status, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "speaker": "Nobody"})
    assert status == 400 and err["error"]["param"] == "speaker" and "Chelsie" in err["error"]["message"]
    status, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "speaker": "Ethan",
                                                          "audio": {"voice": "Chelsie"}})
    assert status == 400 and err["error"]["param"] == "speaker"


def test_realtime_maps_openai_voice_names(server):
    import asyncio

    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None},
                                                                             "output": {"voice": "alloy"}}})
            assert (await until(conn, "session.updated")).session.audio.output.voice == "alloy"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create(response={"max_output_tokens": 3})
            done = (await until(conn, "response.done")).response
            assert ran_to_its_end(done) or done.status == "incomplete", done.status_details
    asyncio.run(go())
    wait_idle(server)


def test_without_the_map_an_openai_voice_is_refused_saying_how_to_map_it():
    info = PipelineInfo("m", ["thinker"], "thinker", "thinker", "talker", voices=("Chelsie", "Ethan"))
    msg = info.unknown_voice("alloy", "audio.voice")
    assert "audio.voice" in msg and "--voice-map alloy=Chelsie" in msg
    assert "--voice-map" not in info.unknown_voice("robot", "audio.voice")  # not an OpenAI name: no hint
    with pytest.raises(ConfigError, match="--voice-map: alloy=Nova: 'Nova' is not a voice"):
        checked_voice_map({"alloy": "Nova"}, info)


@pytest.mark.parametrize("flag,value,expected", [
    ("--voice-map", "alloy", "--voice-map: expected NAME=VOICE pairs"),
    ("--default-modalities", "text,video", "--default-modalities"),
])
def test_bad_options_are_refused_naming_them(capsys, flag, value, expected):
    assert cli.main(["serve", str(CHAIN), "--backend", "local", flag, value]) == 2
    assert expected in capsys.readouterr().err


def test_a_text_pipeline_answers_text_under_a_text_and_audio_default():
    from tests.fakes import fake_factory

    with serve_in_process(CHAIN, "--backend", "local", "--default-modalities", "text,audio",
                          engine_factory=fake_factory) as s:
        status, _, body = s.post("/v1/chat/completions", {"model": "tiny_chain", "messages": HELLO, "max_tokens": 2})
        assert status == 200 and body["choices"][0]["message"].get("audio") is None
