"""Input audio transcription in `/v1/realtime` sessions with the real `openai` client on fake engines (tests/fakes.py;
tiny_chain): a committed clip is transcribed beside the conversation (completed with its usage, or failed alone), and
a session transcribes at most --max-session-responses clips at once."""
from __future__ import annotations

import base64

import pytest

from tests.fakes import fake_factory
from tests.serve.realtime_utils import pcm16, ran_to_its_end, speech_24k, until
from tests.serve.realtime.test_realtime_protocol import _text_turn, run
from tests.serve.server_utils import CHAIN, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny_chain"


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local", engine_factory=fake_factory) as s:
        yield s




def test_input_audio_transcription_completes_or_fails_alone(server):
    """A committed clip is transcribed when the session asks (completed, its usage; the item keeps the transcript);
    a transcription whose request the stage refuses ends with a `failed` event naming the item, and the session
    goes on."""
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            audio = base64.b64encode(pcm16(speech_24k(0.5))).decode()
            for prompt in (None, "__bad__"):  # the fake stage refuses a prompt holding __bad__
                await conn.session.update(session={"type": "realtime", "audio": {"input": {
                    "turn_detection": None, "transcription": {"model": "whisper-1", "prompt": prompt}}}})
                updated = await until(conn, "session.updated")
                assert updated.session.audio.input.transcription.model == "whisper-1"
                await conn.input_audio_buffer.append(audio=audio)
                await conn.input_audio_buffer.commit()
                committed = await until(conn, "input_audio_buffer.committed")
                kind = "completed" if prompt is None else "failed"
                ev = await until(conn, f"conversation.item.input_audio_transcription.{kind}")
                assert (ev.item_id, ev.content_index) == (committed.item_id, 0)
                if prompt is None:
                    # (the fake stages have no tokenizer, so no text: the tiny omni's test reads a real transcript)
                    assert ev.usage.output_tokens > 0 and ev.usage.input_tokens > 0
                    await conn.conversation.item.retrieve(item_id=committed.item_id)
                    item = (await until(conn, "conversation.item.retrieved")).item
                    assert item.content[0].transcript == ev.transcript
                else:
                    assert ev.error.type == "invalid_request_error" and "__bad__" in ev.error.message
            _, done = await _text_turn(conn, "still here?")
            assert ran_to_its_end(done.response)
    run(go())
    wait_idle(server)


def test_a_session_transcribes_at_most_its_response_bound_at_once(server):
    """Transcriptions are pipeline requests of the session: past --max-session-responses (4) running at once, the
    next commit's transcription fails naming the bound; the others complete once the stage goes on."""
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
            await until(conn, "session.updated")
            audio = base64.b64encode(pcm16(speech_24k(0.2))).decode()
            seen: list = []
            with held(server, "thinker") as release:
                for _ in range(5):
                    await conn.input_audio_buffer.append(audio=audio)
                    await conn.input_audio_buffer.commit()
                    await until(conn, "input_audio_buffer.committed", seen)
                failed = await until(conn, "conversation.item.input_audio_transcription.failed", seen)
                assert failed.error.code == "session_response_limit", failed.error
                assert "--max-session-responses 4" in failed.error.message
                release.set()
                for _ in range(4):
                    await until(conn, "conversation.item.input_audio_transcription.completed", seen)
            committed = [e.item_id for e in seen if e.type == "input_audio_buffer.committed"]
            assert failed.item_id == committed[-1]
    run(go())
    wait_idle(server)
