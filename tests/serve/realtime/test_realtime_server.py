"""`/v1/realtime` on the tiny Qwen2.5-Omni (thinker -> talker -> token2wav) with the real `openai` client,
in this process: a spoken turn (real recorded speech, not the model's), audio deltas that are pcm16,
the prefix caches hit from turn 2 on, cancel mid-response, barge-in with server VAD (Silero), 8
concurrent sessions, and a disconnect mid-response that leaves every stage idle."""
from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import pytest

from tests.serve.realtime_utils import pcm16, ran_to_its_end, speech_24k, types, until
from tests.serve.server_utils import OMNI, generating, held, produced, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}, "output": {"voice": "Chelsie"}}}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--audio-chunk-ms", "20") as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def _connect(server, session=MANUAL):
    conn = await server.async_client().realtime.connect(model=MODEL).enter()
    await until(conn, "session.created")
    await conn.session.update(session=session)
    await until(conn, "session.updated")
    return conn


async def _append(conn, audio: np.ndarray, chunk_s: float = 0.1) -> None:
    data = pcm16(audio)
    step = int(24000 * chunk_s) * 2
    for i in range(0, len(data), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + step]).decode())


async def _text_item(conn, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})


def _audio(events) -> np.ndarray:
    chunks = [base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"]
    assert chunks and all(len(c) % 2 == 0 for c in chunks)  # whole pcm16 samples in every delta
    return np.frombuffer(b"".join(chunks), "<i2")


def test_spoken_turn_then_a_cached_second_turn(server):
    async def go():
        conn = await _connect(server)
        try:
            await _append(conn, speech_24k(3.0))
            await conn.input_audio_buffer.commit()
            committed = await until(conn, "input_audio_buffer.committed")
            await conn.response.create()
            seen: list = []
            done1 = await until(conn, "response.done", seen)
            r1 = done1.response
            assert ran_to_its_end(r1), r1.status_details
            audio = _audio(seen)
            assert audio.size > 0 and np.abs(audio).max() > 0
            transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            assert transcript and transcript == next(
                e for e in seen if e.type == "response.output_audio_transcript.done").transcript
            assert r1.output[0].content[0].transcript == transcript
            assert types(seen).index("response.output_audio.delta") < types(seen).index("response.output_audio.done")
            # the audio of a 3 s clip at the model's rate: 75 audio tokens (25 a second), the rest text
            d1 = r1.usage.input_token_details
            assert (d1.audio_tokens, d1.image_tokens, d1.text_tokens) == (75, 0, r1.usage.input_tokens - 75)
            await _text_item(conn, "And then?")
            await conn.response.create()
            done2 = await until(conn, "response.done")
            r2 = done2.response
            assert ran_to_its_end(r2)
            # turn 2 re-sends turn 1 (the spoken item: the same 16 kHz audio) and its reply: the thinker's
            # prefix cache holds at least turn 1's prompt, all but its last partial block of 16
            assert r2.usage.input_token_details.cached_tokens >= (r1.usage.input_tokens // 16 - 1) * 16 > 0
            d2 = r2.usage.input_token_details  # the clip is inside the cached prefix: its 75 tokens are cached
            assert d2.audio_tokens == 75 and d2.cached_tokens_details.audio_tokens == 75
            assert d2.cached_tokens_details.text_tokens == d2.cached_tokens - 75
            # (the reply's text tokens: its audio's codec tokens are output, never in a prompt)
            assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_token_details.text_tokens
            assert committed.item_id != r1.output[0].id
        finally:
            await conn.close()
    run(go())
    wait_idle(server)
    m = server.metrics()
    assert m[("omni_realtime_turn_latency_seconds_count", ())] >= 1
    assert server.stage_gauges("omni_stage_prefix_cache_hits_total")["talker"] > 0


def test_usage_counts_the_audio_and_a_one_token_reply_is_voiced(server):
    """response.done's usage: output_tokens = the reply's text tokens + its audio's, the codec tokens the talker
    generated (output_token_details). max_output_tokens 1 on a spoken reply: the talker voices a thinker reply
    from the thinker's rows of its tokens and the token sampled last has none (transformers' generate fails on a
    one-token reply too), so the reply's text is voiced once whole, the thinker's reply forced to it and eos: the
    response ends "incomplete" (its bound), with its one token's text and that text's audio, never "failed"."""
    tokenizer = server.omni._omni._backend.workers["thinker"].engine.tokenizer
    eos = server.omni._omni._backend.workers["thinker"].engine.model.eos_token_id

    async def turn(conn, **response):
        seen: list = []
        with produced(server, "thinker") as thinker, produced(server, "talker") as talker:
            await _text_item(conn, "Hello there")
            await conn.response.create(**({"response": response} if response else {}))
            done = (await until(conn, "response.done", seen)).response
        return seen, done, thinker, talker

    async def go():
        conn = await _connect(server)
        try:
            seen, done, thinker, talker = await turn(conn)
            assert ran_to_its_end(done), done.status_details
            (text,), (codes,) = thinker.values(), talker.values()
            u = done.usage
            assert (u.output_token_details.text_tokens, u.output_token_details.audio_tokens) == (len(text), len(codes))
            assert u.output_tokens == len(text) + len(codes) and u.total_tokens == u.input_tokens + u.output_tokens

            seen, done, thinker, talker = await turn(conn, max_output_tokens=1)
            assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens"
            transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            assert transcript and done.output[0].content[0].transcript == transcript
            assert _audio(seen).size > 0 and not any(e.type == "error" for e in seen)
            (reply,) = [ids for rid, ids in thinker.items() if not rid.endswith("-voice")]
            assert len(reply) == 1
            voiced = thinker[next(rid for rid in thinker if rid.endswith("-voice"))]
            assert voiced == tokenizer.encode(transcript, add_special_tokens=False) + [eos]
            (codes,) = talker.values()
            u = done.usage
            assert (u.output_token_details.text_tokens, u.output_token_details.audio_tokens) == (1, len(codes))
            assert u.output_tokens == 1 + len(codes)
        finally:
            await conn.close()
    run(go())
    wait_idle(server)


def test_cancel_mid_response(server):
    async def go():
        conn = await _connect(server)
        try:
            await _text_item(conn, "Tell me a long story.")
            with held(server, "talker", until=generating(1)) as release:
                await conn.response.create()
                seen: list = []
                await until(conn, "response.created", seen)
                await conn.response.cancel()
                done = await until(conn, "response.done", seen)
                release.set()
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "client_cancelled"
            assert done.response.output[0].status == "incomplete"
            # no audio was sent: the item keeps no text the user did not hear
            assert not [e for e in seen if e.type == "response.output_audio.delta"]
            assert done.response.output[0].content[0].transcript == ""
        finally:
            await conn.close()
    run(go())
    wait_idle(server)


def test_barge_in_with_server_vad(server):
    vad = {"type": "realtime", "audio": {"output": {"voice": "Chelsie"}, "input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.5, "silence_duration_ms": 1000, "prefix_padding_ms": 200}}}}

    async def go():
        conn = await _connect(server, vad)
        try:
            await _text_item(conn, "Say something long.")
            seen: list = []
            with held(server, "talker", until=generating(1)) as release:
                await conn.response.create()
                created = await until(conn, "response.created", seen)
                # silence, then speech over the reply in progress: a barge-in
                await _append(conn, np.zeros(12000, np.float32))
                await _append(conn, speech_24k(2.0))
                started = await until(conn, "input_audio_buffer.speech_started", seen)
                done = await until(conn, "response.done", seen)
                release.set()
            assert done.response.id == created.response.id and done.response.status == "cancelled"
            assert done.response.status_details.reason == "turn_detected"
            assert done.response.output[0].status == "incomplete"
            assert started.audio_start_ms >= 300  # after the 500 ms of silence, less the prefix padding
            # the user stops talking: the turn is committed and answered without a response.create
            await _append(conn, np.zeros(36000, np.float32))
            stopped = await until(conn, "input_audio_buffer.speech_stopped", seen)
            committed = await until(conn, "input_audio_buffer.committed", seen)
            assert committed.item_id == stopped.item_id == started.item_id
            answer = await until(conn, "response.done", seen)
            assert ran_to_its_end(answer.response)
            assert answer.response.usage.input_token_details.cached_tokens > 0
        finally:
            await conn.close()
    run(go())
    wait_idle(server)
    assert server.metrics()[("omni_realtime_barge_ins_total", ())] >= 1


def test_a_cancelled_response_splits_its_prompt_as_a_completed_one(server):
    """A response cancelled on its first delta (response.cancel, or a server-VAD barge-in) read its whole prompt:
    response.done's input_token_details split it (text, audio, cached) exactly as the same prompt run to completion
    does. (They said every prompt token was text and none cached: the split only came with the stage's final
    output, which a cancelled reply never waits for.) The completed run compared with comes after the cancelled ones
    and a first completed run before them, so all of them meet the prefix cache in the same state."""
    clip = base64.b64encode(pcm16(speech_24k(3.0))).decode()
    vad = {"type": "realtime", "audio": {"output": {"voice": "Chelsie"}, "input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.5, "silence_duration_ms": 1000, "prefix_padding_ms": 200}}}}

    async def turn(session, stop=None):
        """The clip as the conversation's one item, one response: run to its end, or stopped by `stop` at its
        first delta (the talker held meanwhile, so the reply cannot end first)."""
        conn = await _connect(server, session)
        try:
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_audio", "audio": clip}]})
            await until(conn, "conversation.item.done")
            if stop is None:
                await conn.response.create()
                return (await until(conn, "response.done")).response
            with held(server, "talker", until=generating(1)) as release:
                await conn.response.create()
                while not (await conn.recv()).type.startswith(("response.output_audio", "response.output_text")):
                    pass
                await stop(conn)
                done = await until(conn, "response.done")
                release.set()
            return done.response
        finally:
            await conn.close()

    async def cancel(conn):
        await conn.response.cancel()

    async def barge_in(conn):  # silence, then speech over the reply in progress
        await _append(conn, np.zeros(12000, np.float32))
        await _append(conn, speech_24k(2.0, offset_s=3.0))

    async def go():
        first = await turn(MANUAL)
        cancelled = await turn(MANUAL, cancel)
        barged = await turn(vad, barge_in)
        completed = await turn(MANUAL)
        assert ran_to_its_end(first) and ran_to_its_end(completed), (first.status_details, completed.status_details)
        assert (cancelled.status, cancelled.status_details.reason) == ("cancelled", "client_cancelled")
        assert (barged.status, barged.status_details.reason) == ("cancelled", "turn_detected")
        want = completed.usage.input_token_details
        assert want.audio_tokens == 75 and want.cached_tokens > 0 and want.cached_tokens_details.audio_tokens > 0
        for r in (cancelled, barged):
            assert r.usage.input_tokens == completed.usage.input_tokens
            assert r.usage.input_token_details == want, (r.usage.input_token_details, want)
    run(go())
    wait_idle(server)


def test_a_cancelled_response_counts_the_audio_tokens_it_made(server):
    """response.done of a response cancelled while its talker generates: output_token_details.audio_tokens counts the
    talker's codec tokens generated by then (they came with the audio stage's final output only, which a cancelled
    reply never gets: it said 0), output_tokens is text + audio; a completed reply's count stays exact."""
    engine = server.omni._omni._backend.workers["talker"].engine
    made = lambda e: max((r.num_output_tokens for r in e.scheduler.running), default=0) >= 4  # noqa: E731

    async def go():
        conn = await _connect(server)
        try:
            await _text_item(conn, "Tell me a long story about the sea.")
            await until(conn, "conversation.item.done")
            with held(server, "talker", until=made) as release:
                await conn.response.create()
                deadline = time.monotonic() + 120
                while not made(engine):  # the talker stops there until released
                    assert time.monotonic() < deadline, "the talker never generated"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)  # its deltas reach the server
                await conn.response.cancel()
                done = (await until(conn, "response.done")).response
                release.set()
            await _text_item(conn, "And another one.")
            await until(conn, "conversation.item.done")
            await conn.response.create()
            whole = (await until(conn, "response.done")).response
            return done, whole
        finally:
            await conn.close()

    done, whole = run(go())
    details = done.usage.output_token_details
    assert (done.status, details.audio_tokens) == ("cancelled", 4), done.usage
    assert done.usage.output_tokens == details.text_tokens + details.audio_tokens
    assert ran_to_its_end(whole) and whole.usage.output_token_details.audio_tokens > 0
    wait_idle(server)


def test_silence_and_noise_start_no_turn(server):
    vad = {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}

    async def go():
        conn = await _connect(server, vad)
        try:
            noise = (0.02 * np.random.default_rng(0).standard_normal(24000 * 2)).astype(np.float32)
            await _append(conn, np.concatenate([np.zeros(24000, np.float32), noise]))
            await conn.conversation.item.retrieve(item_id="item_none")  # a marker: everything before it is read
            seen: list = []
            await until(conn, "error", seen)
            assert "input_audio_buffer.speech_started" not in types(seen)
        finally:
            await conn.close()
    run(go())


def test_eight_concurrent_sessions(server):
    async def one(i: int) -> tuple[bool, int]:
        conn = await _connect(server)
        try:
            await _text_item(conn, f"Hello from session {i}")
            await conn.response.create()
            seen: list = []
            done = await until(conn, "response.done", seen)
            return ran_to_its_end(done.response), _audio(seen).size
        finally:
            await conn.close()

    async def go():
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = run(go())
    assert all(ended and n > 0 for ended, n in results), results
    wait_idle(server)


def test_disconnect_mid_response_frees_every_stage(server):
    async def go():
        conn = await _connect(server)
        await _text_item(conn, "Keep talking.")
        with held(server, "talker", until=generating(1)):
            await conn.response.create()
            await until(conn, "response.content_part.added")
            await conn.close()
            await asyncio.sleep(0.5)
    run(go())
    kv = wait_idle(server)  # polls until no stage runs, waits for or holds anything
    assert {"thinker", "talker"} <= set(kv) and not any(kv.values())
    assert server.metrics()[("omni_realtime_sessions_open", ())] == 0


def test_vad_turns_in_quick_succession_each_response_ends(server):
    """The whole clip at once (faster than real time) with Silero's pauses: speech stops and starts again
    right after a turn's response was created, so barge-ins cancel responses at every point of their life,
    even before their task ran; every response.created still gets one response.done, and the session
    answers the last turn."""
    vad = {"type": "realtime", "audio": {"output": {"voice": "Chelsie"}, "input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 300}}}}

    async def go():
        conn = await _connect(server, vad)
        try:
            await _append(conn, np.concatenate([speech_24k(), np.zeros(24000, np.float32)]), chunk_s=0.5)
            seen: list = []
            while True:
                ev = await until(conn, "response.done", seen)
                created = [e.response.id for e in seen if e.type == "response.created"]
                ended = [e.response.id for e in seen if e.type == "response.done"]
                if len(ended) == len(created) and ran_to_its_end(ev.response):
                    break
            assert sorted(created) == sorted(ended) and len(set(ended)) == len(ended)
            commits = [e for e in seen if e.type == "input_audio_buffer.committed"]
            assert len(commits) >= 2 and len(created) == len(commits)
        finally:
            await conn.close()
    run(go())
    wait_idle(server)


def test_truncate_keeps_the_text_sent_with_the_audio_heard(server):
    async def go():
        conn = await _connect(server)
        try:
            await _text_item(conn, "Hello there")
            await conn.response.create()
            seen: list = []
            done = await until(conn, "response.done", seen)
            item = done.response.output[0]
            assert item.content[0].transcript
            # the first 20 ms chunk heard: the text sent up to that chunk is kept
            first_audio = next(i for i, e in enumerate(seen) if e.type == "response.output_audio.delta")
            before = "".join(e.delta for e in seen[:first_audio] if e.type == "response.output_audio_transcript.delta")
            for end_ms, kept in ((20, before), (0, "")):  # 0 ms: nothing heard, nothing kept
                await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=end_ms)
                truncated = await until(conn, "conversation.item.truncated")
                assert (truncated.item_id, truncated.audio_end_ms) == (item.id, end_ms)
                await conn.conversation.item.retrieve(item_id=item.id)
                got = await until(conn, "conversation.item.retrieved")
                assert got.item.content[0].transcript == kept and got.item.status == "incomplete"
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=10**7,
                                                  event_id="far")
            err = await until(conn, "error")
            assert (err.error.param, err.error.event_id) == ("audio_end_ms", "far")
        finally:
            await conn.close()
    run(go())


def test_text_response_on_the_audio_pipeline(server):
    """A per-response `output_modalities: ["text"]`: the thinker's text streams, no stage makes audio."""
    async def go():
        conn = await _connect(server)
        try:
            await _text_item(conn, "Hi!")
            await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 6})
            seen: list = []
            done = await until(conn, "response.done", seen)
            text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
            assert text and text == next(e for e in seen if e.type == "response.output_text.done").text
            assert "response.output_audio.delta" not in types(seen)
            assert done.response.output_modalities == ["text"] and 0 < done.response.usage.output_tokens <= 6
            assert done.response.output[0].content[0].type == "output_text"
        finally:
            await conn.close()
    run(go())
    wait_idle(server)


def test_output_speed_changes_the_tempo_of_the_reply(server):
    """session.audio.output.speed (and a response's own): the same reply's audio, len / speed samples (the
    pitch kept: tests/serve/audio/test_time_stretch.py); session.updated reports the speed."""
    async def reply(speed: float | None, per_response: bool = False) -> np.ndarray:
        session = MANUAL if speed is None or per_response else {
            **MANUAL, "audio": {**MANUAL["audio"], "output": {"voice": "Chelsie", "speed": speed}}}
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session=session)
            updated = await until(conn, "session.updated")
            assert updated.session.audio.output.speed == (speed if speed and not per_response else 1.0)
            await _text_item(conn, "Tell me about the sea.")
            params = {"max_output_tokens": 6}
            if per_response:
                params["audio"] = {"output": {"speed": speed}}
            await conn.response.create(response=params)
            seen: list = []
            done = await until(conn, "response.done", seen)
            assert ran_to_its_end(done.response)
            return _audio(seen)
        finally:
            await conn.close()

    async def go():
        normal = await reply(None)
        assert (await reply(1.5)).size == round(normal.size / 1.5)
        assert (await reply(0.5, per_response=True)).size == normal.size * 2
    run(go())
    wait_idle(server)


@pytest.mark.slow
def test_g711_in_and_out(server):
    """A phone line's session: mu-law at 8 kHz in (real speech; server VAD hears it), A-law or mu-law at 8 kHz
    out, a third of the pcm16 samples, the same reply as the pcm16 session's (within G.711's quantisation)."""
    from omni.serve.audio import g711
    from omni.serve.audio.resampling import resample, Resampler8k24k

    async def reply(out_fmt: str | None) -> np.ndarray | bytes:
        audio = {**MANUAL["audio"], "output": {"voice": "Chelsie", **({"format": {"type": out_fmt}} if out_fmt
                                                                        else {})}}
        conn = await _connect(server, {**MANUAL, "audio": audio})
        try:
            await _text_item(conn, "Tell me about the sea.")
            await conn.response.create(response={"max_output_tokens": 6})
            seen: list = []
            done = await until(conn, "response.done", seen)
            assert ran_to_its_end(done.response)
            if out_fmt is None:
                return _audio(seen)
            assert done.response.audio.output.format.type == out_fmt
            return b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
        finally:
            await conn.close()

    async def spoken_mulaw_turn() -> None:
        session = {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": {
                "type": "server_vad", "silence_duration_ms": 1000, "prefix_padding_ms": 200}},
            "output": {"voice": "Chelsie", "format": {"type": "audio/pcmu"}}}}
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session=session)
            updated = await until(conn, "session.updated")
            assert updated.session.audio.input.format.type == updated.session.audio.output.format.type == "audio/pcmu"
            speech8k = resample(np.concatenate([speech_24k(2.0), np.zeros(36000, np.float32)]), 24000, 8000)
            data = g711.encode("audio/pcmu", speech8k)
            for i in range(0, len(data), 160):  # 20 ms frames, as a phone line's media stream sends them
                await conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + 160]).decode())
            seen: list = []
            started = await until(conn, "input_audio_buffer.speech_started", seen)
            stopped = await until(conn, "input_audio_buffer.speech_stopped", seen)
            assert 0 <= started.audio_start_ms < stopped.audio_end_ms <= 3500
            done = await until(conn, "response.done", seen)
            assert ran_to_its_end(done.response), done.response.status_details
            assert done.response.usage.input_tokens > 0
            out = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
            assert out and done.response.audio.output.format.type == "audio/pcmu"
        finally:
            await conn.close()

    async def go():
        pcm = (await reply(None)).astype(np.float32) / 32767.0
        mulaw, alaw = await reply("audio/pcmu"), await reply("audio/pcma")
        want = Resampler8k24k(up=False).push(pcm)  # the pcm16 reply brought to 8 kHz
        assert len(mulaw) == len(alaw) == want.size == -(-pcm.size // 3)
        for fmt, data in (("audio/pcmu", mulaw), ("audio/pcma", alaw)):
            # The server encodes the float reply, the reference its pcm16 (rounded to 1/32767): a sample on a
            # code boundary may round the other way, nothing else differs.
            same = np.frombuffer(data, np.uint8) == np.frombuffer(g711.encode(fmt, want), np.uint8)
            assert same.mean() > 0.9, (fmt, same.mean())
        await spoken_mulaw_turn()
    run(go())
    wait_idle(server)


def test_vad_turned_on_mid_session_keeps_the_session_clock(server):
    """Speech times are on the session's audio clock (ms since its first audio), whenever VAD started."""
    async def go():
        conn = await _connect(server)  # manual turns first
        try:
            await _append(conn, np.zeros(24000, np.float32))  # 1 s
            await conn.input_audio_buffer.commit()
            await until(conn, "input_audio_buffer.committed")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 1000, "prefix_padding_ms": 0,
                "create_response": False}}}})
            await until(conn, "session.updated")
            await _append(conn, np.concatenate([np.zeros(12000, np.float32), speech_24k(2.0),
                                                np.zeros(36000, np.float32)]))
            started = await until(conn, "input_audio_buffer.speech_started")
            stopped = await until(conn, "input_audio_buffer.speech_stopped")
            # 1 s before VAD started + 0.5 s of silence: the speech starts at 1.5 s or later
            assert 1500 <= started.audio_start_ms < stopped.audio_end_ms <= 1000 + 500 + 2000 + 100
            await until(conn, "input_audio_buffer.committed")
        finally:
            await conn.close()
    run(go())


def test_input_audio_transcription_by_the_pipelines_own_thinker(server):
    """`audio.input.transcription` (as OpenAI's clients ask for it, naming their model): each committed clip is
    transcribed by the pipeline's thinker, beside the response; the deltas add up to the completed transcript,
    which is exactly the thinker's greedy reply to the speech-recognition prompt on the very same 16 kHz samples
    (asked here through chat completions), and the item keeps it."""
    import io

    import soundfile as sf

    from omni.serve.audio.codecs import pcm16_to_float
    from omni.serve.audio.resampling import resample
    from omni.serve.generation.asr_job import ASR_SYSTEM, instruction

    speech = speech_24k(2.0, offset_s=1.0)
    asked = {"type": "realtime", "audio": {"input": {"turn_detection": None, "transcription": {
        "model": "gpt-4o-transcribe", "language": "en"}}, "output": {"voice": "Chelsie"}}}

    async def go():
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session=asked)
            updated = await until(conn, "session.updated")
            assert updated.session.audio.input.transcription.model == "gpt-4o-transcribe"
            await _append(conn, speech)
            await conn.input_audio_buffer.commit()
            seen: list = []
            committed = await until(conn, "input_audio_buffer.committed", seen)
            await conn.response.create()  # a response runs beside the transcription
            done = await until(conn, "conversation.item.input_audio_transcription.completed", seen)
            deltas = [e for e in seen if e.type == "conversation.item.input_audio_transcription.delta"]
            assert done.item_id == committed.item_id and done.content_index == 0
            assert all(e.item_id == committed.item_id for e in deltas)
            assert done.transcript and "".join(e.delta for e in deltas) == done.transcript
            assert done.usage.input_tokens > 30 and done.usage.output_tokens > 0
            if not any(e.type == "response.done" for e in seen):
                await until(conn, "response.done")
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            item = (await until(conn, "conversation.item.retrieved")).item
            assert item.content[0].transcript == done.transcript
            # no transcription once the session asks for none
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": None}}})
            assert (await until(conn, "session.updated")).session.audio.input.transcription is None
            await _append(conn, speech)
            await conn.input_audio_buffer.commit()
            after: list = []
            await until(conn, "conversation.item.done", after)
            await conn.response.create()
            await until(conn, "response.done", after)
            assert not any("transcription" in e.type for e in after)
            return done.transcript, done.usage.output_tokens
        finally:
            await conn.close()

    transcript, tokens = run(go())
    wave16 = resample(pcm16_to_float(pcm16(speech)), 24000, 16000)  # what the session committed
    buf = io.BytesIO()
    sf.write(buf, wave16, 16000, format="WAV", subtype="FLOAT")  # read back exactly
    same = server.client().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=32, messages=[
            {"role": "system", "content": ASR_SYSTEM},
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                        "format": "wav"}},
                {"type": "text", "text": instruction("transcribe", "en", None)}]}])
    assert same.choices[0].message.content == transcript and same.usage.completion_tokens == tokens
    wait_idle(server)


@pytest.mark.slow
def test_a_long_turn_an_interrupted_reply_and_a_refused_response(server):
    """A spoken turn longer than the audio encoder's 30 s window is heard as consecutive clips (it once failed
    every later response of the session); truncating the reply still being made stops it and keeps only what was
    heard (it was acknowledged, then undone by the rest of the reply); a response a stage refuses fails with an
    error naming its response.create and the field, and max_output_tokens is a bound, never a reservation."""
    async def go():
        conn = await _connect(server)
        try:
            await _append(conn, np.concatenate([speech_24k()] * 4), chunk_s=1.0)  # ~40 s of recorded speech
            await conn.input_audio_buffer.commit()
            first_user = (await until(conn, "input_audio_buffer.committed")).item_id
            await conn.response.create()
            done = await until(conn, "response.done")
            assert ran_to_its_end(done.response), done.response.status_details
            assert done.response.usage.input_tokens > 800  # the whole 40 s were heard
            await _text_item(conn, "And now?")
            await conn.response.create()
            assert ran_to_its_end((await until(conn, "response.done")).response)

            await _text_item(conn, "Tell me a long story.")
            with held(server, "talker"):  # the reply's text is out, its audio is not: the user stops it there
                await conn.response.create()
                seen: list = []
                added = await until(conn, "response.output_item.added", seen)
                await until(conn, "response.output_audio_transcript.delta", seen)
                await conn.conversation.item.truncate(item_id=added.item.id, content_index=0, audio_end_ms=0)
                truncated = await until(conn, "conversation.item.truncated", seen)
            ended = next(e for e in seen if e.type == "response.done")  # the reply stopped before the ack
            assert ended.response.status == "cancelled" and truncated.audio_end_ms == 0
            await conn.conversation.item.retrieve(item_id=added.item.id)
            item = (await until(conn, "conversation.item.retrieved")).item
            assert item.status == "incomplete" and item.content[0].transcript == ""

            # max_output_tokens is a bound: more than the context leaves is not an error (it failed every turn)
            await conn.response.create(response={"max_output_tokens": 4096, "output_modalities": ["text"]})
            assert ran_to_its_end((await until(conn, "response.done")).response)
            await conn.response.create(event_id="too-long", response={"instructions": "Listen. " * 2100})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param, err.error.code) == (
                "too-long", "conversation", "context_length_exceeded"), err.error
            assert (await until(conn, "response.done")).response.status == "failed"

            # another 40 s turn: the conversation outgrows the thinker's 2,048 tokens; truncation "auto" (OpenAI's
            # default) leaves its oldest items out of the prompt (it failed every later response), and keeps them
            # in the conversation. The failed response above dropped nothing (its instructions alone were too long).
            await _append(conn, np.concatenate([speech_24k()] * 4), chunk_s=1.0)
            await conn.input_audio_buffer.commit()
            await until(conn, "input_audio_buffer.committed")
            await conn.response.create()
            done = (await until(conn, "response.done")).response
            assert ran_to_its_end(done), done.status_details
            # the prompt left the talker (its 32 tokens, a few markers) room: the thinker's reserve
            assert server.omni.context_reserve() == 32 + 8
            assert 1000 < done.usage.input_tokens <= 2048 - 40 - done.usage.output_token_details.text_tokens
            assert done.usage.input_token_details.audio_tokens < 1100
            await conn.conversation.item.retrieve(item_id=first_user)
            assert (await until(conn, "conversation.item.retrieved")).item.id == first_user
        finally:
            await conn.close()
    run(go())
    wait_idle(server)


def test_a_refused_session_update_changes_nothing_and_voices_are_checked(server):
    """session.update is all or nothing (a refused field once left the fields before it applied, unannounced), and
    a voice the talker does not have (OpenAI's default "alloy") is refused at the update, not at every response."""
    async def go():
        conn = await _connect(server)
        try:
            await conn.session.update(event_id="bad", session={
                "type": "realtime", "output_modalities": ["text"], "instructions": "SHOULD NOT APPLY",
                "audio": {"input": {"turn_detection": {"type": "server_vad"}}, "output": {"voice": "alloy"}}})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param) == ("bad", "session.audio.output.voice"), err.error
            assert "Chelsie" in err.error.message
            # tools on a thinker whose prompt format has none: refused at the update (it failed every response)
            assert server.omni.shows_tools() is False
            await conn.session.update(event_id="tools", session={"type": "realtime", "tools": [
                {"type": "function", "name": "f"}], "tool_choice": "required"})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param, err.error.code) == ("tools", "session.tools",
                                                                             "unsupported_value"), err.error
            await conn.session.update(session={"type": "realtime"})
            now = (await until(conn, "session.updated")).session
            assert now.output_modalities == ["audio"] and now.instructions == ""
            assert now.audio.input.turn_detection is None and now.audio.output.voice == "Chelsie"
            await _text_item(conn, "Hello")
            await conn.response.create(event_id="r", response={"audio": {"output": {"voice": "nova"}}})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param) == ("r", "response.audio.output.voice"), err.error
            await conn.response.create(response={"audio": {"output": {"voice": "ethan"}}})
            assert ran_to_its_end((await until(conn, "response.done")).response)
        finally:
            await conn.close()
    run(go())
    wait_idle(server)

