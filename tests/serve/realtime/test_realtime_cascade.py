"""`/v1/realtime` on a voice agent's cascade (stage_configs/voice_agent_tiny.yaml: tiny random Qwen3-ASR -> SmolLM2
-> tiny random Higgs Audio v2 and its codec) with the real `openai` client, in this process: a spoken turn (real
recorded speech) gets its transcription from the pipeline's own recognizer and a spoken reply; turn 2 hits the LLM's
prefix cache; a cancelled response (barge-in) stops every stage and the next turn still works; a disconnect frees
every stage; a voice the TTS does not know is refused as an error the session survives, and a typed turn is
answered (the recognizer hears nothing). The random recognizer writes
gibberish: the events and their structure are checked, not words."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from tests.serve.realtime_utils import connect, pcm16, ran_to_its_end, speech_24k, types, until
from tests.serve.server_utils import REPO, generating, held, serve_in_process, wait_idle

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
CONFIG = REPO / "stage_configs" / "voice_agent_tiny.yaml"
MODEL = "voice_agent_tiny"
# manual turns, short replies (the LLM's reply is bounded: each turn stays fast), the server's default voice
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 8}
STAGES = {"asr", "llm", "tts"}  # those with a KV cache (the codec has none)


@pytest.fixture(scope="module")
def server(smollm2):
    with serve_in_process(CONFIG, "--backend", "local", "--audio-chunk-ms", "20") as s:
        yield s


async def _connect(server):
    return await connect(server, MODEL, MANUAL)


async def _speak(conn, seconds: float, offset_s: float = 0.0) -> str:
    """A spoken turn committed; its item's id."""
    data = pcm16(speech_24k(seconds, offset_s))
    step = 2400 * 2
    for i in range(0, len(data), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + step]).decode())
    await conn.input_audio_buffer.commit()
    return (await until(conn, "input_audio_buffer.committed")).item_id


def _heard(events, item_id: str) -> str:
    """The turn's transcription: its deltas joined are its completed transcript."""
    (done,) = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert done.item_id == item_id and done.transcript.strip()
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta"
                     and e.item_id == item_id)
    assert deltas == done.transcript and "<asr_text>" not in done.transcript  # the language tag dropped
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0
    return done.transcript


def _audio(events) -> np.ndarray:
    chunks = [base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"]
    assert chunks and all(len(c) % 2 == 0 for c in chunks)  # whole pcm16 samples in every delta
    return np.frombuffer(b"".join(chunks), "<i2")


def test_spoken_turns_are_transcribed_answered_and_cached(server):
    async def go():
        conn = await _connect(server)
        try:
            item1 = await _speak(conn, 2.0)
            await conn.response.create()
            seen: list = []
            r1 = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(r1), r1.status_details
            heard1 = _heard(seen, item1)
            reply = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            assert reply and reply == r1.output[0].content[0].transcript
            audio = _audio(seen)
            assert audio.size > 0 and np.abs(audio).max() > 0
            await conn.conversation.item.retrieve(item_id=item1)
            kept = (await until(conn, "conversation.item.retrieved")).item
            assert kept.content[0].transcript == heard1  # what turn 2 sends the LLM for it
            item2 = await _speak(conn, 2.0, offset_s=3.0)
            await conn.response.create(response={"output_modalities": ["text"]})
            seen = []
            r2 = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(r2), r2.status_details
            _heard(seen, item2)
            text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
            assert text and "response.output_audio.delta" not in types(seen)
            # turn 2's LLM prompt starts with turn 1's (its transcript, then its reply): the prefix cache holds it
            assert r2.usage.input_token_details.cached_tokens > 0
            assert r2.usage.input_tokens > r1.usage.input_tokens
            assert r1.usage.input_token_details.audio_tokens == 0  # the LLM reads text
        finally:
            await conn.close()
    asyncio.run(go())
    wait_idle(server)


def test_barge_in_cancels_every_stage_and_the_next_turn_works(server):
    async def go():
        conn = await _connect(server)
        try:
            with held(server, "tts", until=generating(1)):  # the reply cannot finish before the cancel
                await _speak(conn, 2.0)
                await conn.response.create()
                await until(conn, "response.output_audio_transcript.delta")
                await conn.response.cancel()
                cancelled = (await until(conn, "response.done")).response
            assert cancelled.status == "cancelled"
            await asyncio.to_thread(wait_idle, server)  # nothing left running on any stage
            item = await _speak(conn, 2.0, offset_s=5.0)
            await conn.response.create()
            seen: list = []
            again = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(again), again.status_details
            _heard(seen, item)
            assert _audio(seen).size > 0
        finally:
            await conn.close()
    asyncio.run(go())
    wait_idle(server)


def test_disconnect_mid_response_frees_every_stage(server):
    async def go():
        conn = await _connect(server)
        with held(server, "tts", until=generating(1)):
            await _speak(conn, 2.0)
            await conn.response.create()
            await until(conn, "response.output_audio_transcript.delta")
            await conn.close()
            await asyncio.sleep(0.5)
    asyncio.run(go())
    kv = wait_idle(server)  # no stage runs, waits for or holds anything: every block is free
    assert STAGES <= set(kv) and not any(kv.values())
    assert server.metrics()[("omni_realtime_sessions_open", ())] == 0


def test_a_refused_voice_leaves_the_session_on_and_a_typed_turn_is_answered(server):
    async def go():
        conn = await _connect(server)
        try:
            # no --voice-dir: the speech stage names no voices, so a named one is refused at the update (not by
            # every response's TTS); the default voice stays
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "alloy"}}})
            err = await until(conn, "error")
            assert (err.error.param, err.error.code) == ("session.audio.output.voice", "invalid_value"), err.error
            assert "--voice-dir" in err.error.message
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello"}]})
            await until(conn, "conversation.item.done")
            await conn.response.create(event_id="typed", response={"output_modalities": ["text"]})
            done = await until(conn, "response.done")  # the recognizer hears nothing; the LLM reads the text
            assert ran_to_its_end(done.response), done.response.status_details
            assert done.response.output[0].content[0].text
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
            assert (await until(conn, "session.updated")).session.audio.output.voice is None
        finally:
            await conn.close()
    asyncio.run(go())


def test_an_unanswered_turn_is_transcribed_before_the_next_response(server):
    """Two turns committed, one response: the first turn's audio is no longer the newest, so it is transcribed on
    its own (the LLM reads every earlier turn as text) and the response answers the second."""
    async def go():
        conn = await _connect(server)
        try:
            item1 = await _speak(conn, 1.5)
            item2 = await _speak(conn, 1.5, offset_s=3.0)
            await conn.response.create(response={"output_modalities": ["text"]})
            seen: list = []
            done = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(done), done.status_details
            heard = [e.item_id for e in seen if e.type == "conversation.item.input_audio_transcription.completed"]
            assert heard == [item1, item2]
        finally:
            await conn.close()
    asyncio.run(go())
    wait_idle(server)


def test_chat_completions_hear_a_clip_and_answer_aloud_and_a_typed_turn_too(server):
    """The cascade behind chat completions: an input_audio part is the turn the recognizer hears, the reply's
    content is the LLM's text (not the transcript) and its audio the codec's; a typed turn skips the recognizer."""
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes(pcm16(speech_24k(1.5)))
    client = server.client()
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    for content in ([clip], "Tell me about the moon."):
        out = client.chat.completions.create(model=MODEL, modalities=["text", "audio"], max_tokens=8,
                                             messages=[{"role": "user", "content": content}])
        msg = out.choices[0].message
        assert msg.audio is not None and len(base64.b64decode(msg.audio.data)) > 44
        reply = msg.audio.transcript
        assert reply and "<asr_text>" not in reply and out.usage.completion_tokens > 0
        if isinstance(content, str):
            assert "moon" in reply.lower()  # SmolLM2 read the typed turn
    wait_idle(server)


def test_a_transcription_runs_the_recognizer_alone(server):
    """/v1/audio/transcriptions on the cascade is the recognizer's transcript: the LLM and the TTS behind it never
    get the request (a transcription once started the LLM too: both are text stages)."""
    import io
    import wave

    submitted = lambda: {n: s["orchestrator"]["submitted"]  # noqa: E731
                         for n, s in server.omni._omni.stats()["stages"].items()}
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes(pcm16(speech_24k(1.5)))
    before = submitted()
    out = server.client().audio.transcriptions.create(model=MODEL, file=("turn.wav", buf.getvalue(), "audio/wav"),
                                                      response_format="verbose_json")
    assert out.text.strip() and "<asr_text>" not in out.text and out.duration == pytest.approx(1.5, abs=0.01)
    after = submitted()
    assert after["asr"] - before["asr"] == 1
    assert (after["llm"], after["tts"], after["codec"]) == (before["llm"], before["tts"], before["codec"])
    wait_idle(server)


BECKETT = "Hello there, this is how my voice sounds."


def test_an_uploaded_voice_is_the_voice_agents_voice_in_chat_speech_and_realtime(smollm2, tmp_path):
    """POST /v1/audio/voices on a voice agent: its speech stage clones the clip. A chat reply, a speech request and a
    realtime response that name the uploaded voice are spoken in it: the same audio as in the --voice-dir voice made
    of the same clip and transcript, not the default voice's. Once deleted, the name is refused again."""
    import io

    import openai
    import soundfile as sf

    from tests.serve.realtime_utils import speech_wav
    from tests.serve.server_utils import delete_voice, upload_voice

    wave_, rate = sf.read(speech_wav(), dtype="float32")
    voices = tmp_path / "voices"
    voices.mkdir()
    sf.write(voices / "Beckett.wav", wave_[: 3 * rate], rate)
    (voices / "Beckett.txt").write_text(BECKETT + "\n")
    buf = io.BytesIO()
    sf.write(buf, wave_[: 3 * rate], rate, format="WAV")
    with serve_in_process(CONFIG, "--backend", "local", "--voice-dir", str(voices)) as srv:
        client = srv.client()
        status, body = upload_voice(srv, "guest", buf.getvalue(), BECKETT)
        assert status == 200 and body["voice"]["name"] == "guest", body
        assert srv.get("/v1/audio/voices")[2]["voices"] == ["Beckett", "guest"]

        def chat(voice: str | None) -> tuple[str, bytes]:
            msg = client.chat.completions.create(
                model=MODEL, modalities=["text", "audio"], max_tokens=8,
                messages=[{"role": "user", "content": "Tell me about the moon."}],
                **({"audio": {"voice": voice, "format": "wav"}} if voice else {})).choices[0].message
            return msg.audio.transcript, base64.b64decode(msg.audio.data)

        (text, guest), (same_text, beckett), (_, default) = chat("guest"), chat("Beckett"), chat(None)
        assert text == same_text and guest == beckett and guest != default

        def speech(voice: str) -> bytes:
            return client.audio.speech.create(model=MODEL, input="Water the plants.", voice=voice,
                                              response_format="wav").content

        assert speech("guest") == speech("Beckett")

        async def realtime(voice: str) -> bytes:
            conn = await connect(srv, MODEL, {**MANUAL, "audio": {**MANUAL["audio"], "output": {"voice": voice}}})
            try:
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Tell me about the moon."}]})
                await until(conn, "conversation.item.done")
                await conn.response.create()
                seen: list = []
                done = (await until(conn, "response.done", seen)).response
                assert ran_to_its_end(done), done.status_details
                return _audio(seen).tobytes()
            finally:
                await conn.close()

        assert asyncio.run(realtime("guest")) == asyncio.run(realtime("Beckett"))
        assert delete_voice(srv, "guest")[0] == 200
        with pytest.raises(openai.BadRequestError) as e:
            chat("guest")
        assert e.value.body["param"] == "audio.voice"
        wait_idle(srv)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}


def test_tools_are_the_llms_behind_the_recognizer(server):
    """A voice agent's tools are its LLM's: the recognizer hands the conversation and its tools on (they were
    refused as tools its own prompt does not show). A forced tool_choice gets a call from SmolLM2, in chat
    completions and as a realtime response's function_call item (no audio: a call is not spoken)."""
    import json

    ask = "What is the weather in Oslo tomorrow?"
    out = server.client().chat.completions.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": ask}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "days"}

    async def go():
        conn = await _connect(server)
        try:
            await conn.session.update(session={"type": "realtime", "tool_choice": "required", "tools": [
                {"type": "function", "name": "get_weather", "parameters": WEATHER}]})
            await until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": ask}]})
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"max_output_tokens": 80})
            seen: list = []
            done = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(done), done.status_details
            assert [o.type for o in done.output] == ["function_call"] and done.output[0].name == "get_weather"
            assert set(json.loads(done.output[0].arguments)) == {"city", "days"}
            assert "response.output_audio.delta" not in types(seen)
        finally:
            await conn.close()
    asyncio.run(go())
    wait_idle(server)
