"""`/v1/realtime` protocol tests with the real `openai` client (`client.realtime.connect`) on fake engines
(tests/fakes.py; tiny_chain: a text pipeline, so every response is text): every client event, the error
paths (an `error` event naming the event and field, the session still serving), the handshake's checks,
the session limits, cancel and disconnect (the stages hold nothing afterwards)."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
import websockets

from tests.fakes import fake_factory
from tests.serve.realtime_utils import pcm16, ran_to_its_end, speech_24k, types, until
from tests.serve.server_utils import CHAIN, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny_chain"


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local", "--max-sessions", "3", "--session-idle-timeout-s", "30",
                          engine_factory=fake_factory) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def _text_turn(conn, text: str) -> tuple[list, object]:
    seen: list = []
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create()
    done = await until(conn, "response.done", seen)
    return seen, done


def test_session_created_update_and_a_text_turn(server):
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.model == MODEL
            assert created.session.output_modalities == ["text"]  # no audio stage in this pipeline
            assert created.session.truncation == "auto"  # OpenAI's default: oldest items leave a full context
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                               "max_output_tokens": 5, "truncation": "disabled",
                                               "audio": {"input": {"turn_detection": None}}})
            updated = await until(conn, "session.updated")
            assert updated.session.instructions == "Be brief." and updated.session.max_output_tokens == 5
            assert updated.session.truncation == "disabled"
            assert updated.session.audio.input.turn_detection is None
            seen, done = await _text_turn(conn, "Hello")
            assert types(seen)[:2] == ["conversation.item.added", "conversation.item.done"]
            assert types(seen)[2:6] == ["response.created", "response.output_item.added", "conversation.item.added",
                                        "response.content_part.added"]
            deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
            text_done = next(e for e in seen if e.type == "response.output_text.done")
            # the fake engines stream no deltas: the text is empty here (the tiny omni's tests read real text)
            assert "".join(deltas) == text_done.text
            r = done.response
            # the reply stopped at max_output_tokens: OpenAI's "incomplete", the item too
            assert r.status == "incomplete" and r.status_details.reason == "max_output_tokens"
            assert r.output[0].role == "assistant" and r.output[0].status == "incomplete"
            assert r.output[0].content[0].text == text_done.text
            assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0  # max_output_tokens reached the thinker
    run(go())
    wait_idle(server)


def test_each_turn_resends_the_conversation(server):
    """Turn 2's prompt is turn 1's conversation + the new item; deleting an item takes it out of the next."""
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            seen, d1 = await _text_turn(conn, "First question")
            first_user = seen[0].item.id
            _, d2 = await _text_turn(conn, "Second")
            assert d2.response.usage.input_tokens > d1.response.usage.input_tokens
            reply = d1.response.output[0].id
            await conn.conversation.item.retrieve(item_id=reply)
            got = await until(conn, "conversation.item.retrieved")
            assert got.item.id == reply and got.item.role == "assistant"
            await conn.conversation.item.delete(item_id=first_user)
            assert (await until(conn, "conversation.item.deleted")).item_id == first_user
            _, d3 = await _text_turn(conn, "Second")
            assert d3.response.usage.input_tokens < d2.response.usage.input_tokens  # "First question" is gone
    run(go())


BAD_EVENTS = [
    ({"type": "no.such.event", "event_id": "e1"}, "type", "invalid_event"),
    ({"type": "session.update", "event_id": "e2", "session": {"type": "realtime", "frobnicate": 1}},
     "session.frobnicate", "unknown_parameter"),
    ({"type": "session.update", "event_id": "e3", "session": {"audio": {"input": {"format": {"type": "audio/g729"}}}}},
     "session.audio.input.format.type", "invalid_value"),
    ({"type": "session.update", "event_id": "e3b", "session": {"audio": {"output": {"format": {
        "type": "audio/pcmu", "rate": 24000}}}}}, "session.audio.output.format", "invalid_value"),  # 8 kHz only
    ({"type": "session.update", "event_id": "e4", "session": {"output_modalities": ["audio"]}},
     "session.output_modalities", "invalid_value"),  # no audio stage in this pipeline
    ({"type": "session.update", "event_id": "e5", "session": {"model": "gpt-realtime"}}, "session.model",
     "model_not_found"),
    # calls are read from replies only on a server started as vLLM's (--enable-auto-tool-choice ...)
    ({"type": "session.update", "event_id": "e6", "session": {"tools": [{"type": "function", "name": "f"}]}},
     "session.tools", "unsupported_value"),
    ({"type": "session.update", "event_id": "e6b", "session": {"tool_choice": "required"}}, "session.tool_choice",
     "invalid_value"),
    ({"type": "session.update", "event_id": "e6d", "session": {"tools": [{"type": "function", "name": "f"}],
                                                              "tool_choice": {"type": "function", "name": "g"}}},
     "session.tool_choice.name", "invalid_value"),
    ({"type": "session.update", "event_id": "e6e", "session": {"tool_choice": {"type": "mcp", "server_label": "x"}}},
     "session.tool_choice", "invalid_value"),
    ({"type": "conversation.item.create", "event_id": "e6c", "item": {"type": "function_call_output", "output": "x"}},
     "item.call_id", "missing_required_parameter"),
    ({"type": "session.update", "event_id": "e7", "session": {"audio": {"output": {"speed": 1.6}}}},  # OpenAI: 0.25-1.5
     "session.audio.output.speed", "invalid_value"),
    ({"type": "session.update", "event_id": "e7b", "session": {"audio": {"output": {"voice": 5}}}},
     "session.audio.output.voice", "invalid_value"),
    ({"type": "session.update", "event_id": "e7c", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 2}}}}}, "session.audio.input.turn_detection.threshold", "invalid_value"),
    ({"type": "session.update", "event_id": "e7d", "session": {"audio": {"input": {"transcription": {
        "model": "whisper-1", "language": "English"}}}}}, "session.audio.input.transcription.language",
     "invalid_value"),
    ({"type": "session.update", "event_id": "e7d2", "session": {"audio": {"input": {"transcription": {
        "model": "whisper-1", "language": "zz"}}}}}, "session.audio.input.transcription.language",
     "invalid_value"),  # two letters, but no language
    ({"type": "session.update", "event_id": "e7e", "session": {"audio": {"input": {"noise_reduction": {
        "type": "near_field"}}}}}, "session.audio.input.noise_reduction", "invalid_value"),
    ({"type": "session.update", "event_id": "e7f", "session": {"truncation": {"type": "retention_ratio",
                                                                             "retention_ratio": 0.5}}},
     "session.truncation", "invalid_value"),  # "auto" (the default) and "disabled" only
    ({"type": "input_audio_buffer.append", "event_id": "e8", "audio": "not base64!"}, "audio", "invalid_value"),
    ({"type": "input_audio_buffer.append", "event_id": "e9", "audio": base64.b64encode(b"abc").decode()}, "audio",
     "invalid_value"),
    ({"type": "input_audio_buffer.append", "event_id": "e10"}, "audio", "missing_required_parameter"),
    ({"type": "input_audio_buffer.commit", "event_id": "e11"}, None, "input_audio_buffer_commit_empty"),
    ({"type": "conversation.item.create", "event_id": "e12", "item": {"type": "message", "role": "user",
                                                                      "content": [{"type": "output_audio"}]}},
     "item.content[0].type", "invalid_value"),
    ({"type": "conversation.item.create", "event_id": "e13", "previous_item_id": "item_nope",
      "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}},
     "previous_item_id", "item_not_found"),
    ({"type": "conversation.item.create", "event_id": "e13b", "item": {"type": "mcp_call", "id": "x"}}, "item",
     "invalid_value"),
    ({"type": "response.create", "event_id": "e13c", "response": {"conversation": "none", "input": []}},
     "response.input", "invalid_value"),  # nothing to answer: no items, no instructions
    ({"type": "conversation.item.delete", "event_id": "e14", "item_id": "item_nope"}, "item_id", "item_not_found"),
    ({"type": "conversation.item.truncate", "event_id": "e15", "item_id": "item_nope", "content_index": 0,
      "audio_end_ms": 10}, "item_id", "item_not_found"),
    ({"type": "response.cancel", "event_id": "e16"}, None, "response_cancel_not_active"),
    ({"type": "response.create", "event_id": "e16b", "response": {"max_output_tokens": 0}},
     "response.max_output_tokens", "invalid_value"),  # as session.update refuses it (it started a response)
    ({"type": "response.create", "event_id": "e17", "response": {"conversation": "conv_1"}}, "response.conversation",
     "invalid_value"),
]


def test_bad_events_are_error_events_and_the_session_goes_on(server):
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            for event, param, code in BAD_EVENTS:
                await conn.send(event)
                err = await until(conn, "error")
                assert (err.error.event_id, err.error.param, err.error.code) == (event["event_id"], param, code), \
                    (event, err.error)
                assert err.error.type == "invalid_request_error" and err.error.message
            await conn._connection.send("{not json")  # a malformed frame as a browser might send it
            assert (await until(conn, "error")).error.code == "invalid_json"
            # nested deeper than the JSON decoder recurses: an error too, never a closed session
            await conn._connection.send('{"type": "session.update", "session": {"metadata": ' + "[" * 5000
                                        + "]" * 5000 + "}}")
            assert (await until(conn, "error")).error.code == "invalid_json"
            _, done = await _text_turn(conn, "still here?")
            assert ran_to_its_end(done.response)
    run(go())
    wait_idle(server)


def test_a_second_response_while_one_runs_is_refused_and_cancel_ends_it(server):
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            with held(server, "thinker") as release:
                seen: list = []
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "wait"}]})
                await conn.response.create()
                created = await until(conn, "response.created", seen)
                await conn.response.create(event_id="again")
                err = await until(conn, "error", seen)
                assert err.error.code == "conversation_already_has_active_response" and err.error.event_id == "again"
                await conn.response.cancel(event_id="stop")
                done = await until(conn, "response.done", seen)
                release.set()
            assert done.response.id == created.response.id and done.response.status == "cancelled"
            assert done.response.status_details.reason == "client_cancelled"
            assert done.response.output[0].status == "incomplete"
            _, again = await _text_turn(conn, "and now?")
            assert ran_to_its_end(again.response)
    run(go())
    wait_idle(server)


def test_disconnect_mid_response_frees_everything(server):
    async def go():
        with held(server, "thinker"):  # the response's text stage: it cannot finish before the close
            conn = await server.async_client().realtime.connect(model=MODEL).enter()
            await until(conn, "session.created")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "long"}]})
            await conn.response.create()
            await until(conn, "response.created")
            await conn.close()  # the server sees the close, cancels the response, aborts the request
    run(go())
    kv = wait_idle(server)  # no stage runs, waits for or holds anything
    assert not any(kv.values())
    m = server.metrics()
    assert m[("omni_realtime_sessions_open", ())] == 0
    assert m[("omni_realtime_turns_total", (("status", "cancelled"),))] >= 1


def test_wrong_model_is_an_error_event_then_close(server):
    async def go():
        async with server.async_client().realtime.connect(model="gpt-realtime") as conn:
            err = await conn.recv()
            assert err.type == "error" and err.error.param == "model" and err.error.code == "model_not_found"
            assert "gpt-realtime" in err.error.message
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await conn.recv()
            assert closed.value.rcvd.code == 1008
    run(go())


def test_max_sessions_refuses_with_1013_and_frees_on_close(server):
    async def go():
        client = server.async_client()
        conns = [await client.realtime.connect(model=MODEL).enter() for _ in range(3)]
        for c in conns:
            await until(c, "session.created")
        extra = await client.realtime.connect(model=MODEL).enter()
        err = await extra.recv()
        assert err.type == "error" and err.error.code == "session_limit_reached"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await extra.recv()
        assert closed.value.rcvd.code == 1013
        await conns[0].close()
        for _ in range(200):  # the server notices the close on its own time
            if server.metrics()[("omni_realtime_sessions_open", ())] == 2:
                break
            await asyncio.sleep(0.05)
        again = await client.realtime.connect(model=MODEL).enter()
        assert (await again.recv()).type == "session.created"
        for c in (*conns[1:], again):
            await c.close()
    run(go())


@pytest.mark.slow  # a server of its own, and idle timeouts to wait out
def test_api_key_and_idle_timeout():
    with serve_in_process(CHAIN, "--backend", "local", "--api-key", "sekret", "--session-idle-timeout-s", "0.5",
                          engine_factory=fake_factory) as s:
        async def go():
            with pytest.raises(websockets.InvalidStatus) as refused:
                await s.async_client(api_key="wrong").realtime.connect(model=MODEL).enter()
            assert refused.value.response.status_code == 401
            assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
            # a browser's form: no headers, the key as a subprotocol next to "realtime"
            ws_url = s.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
            async with websockets.connect(ws_url, subprotocols=["realtime", "openai-insecure-api-key.sekret"]) as ws:
                assert ws.subprotocol == "realtime"
                assert json.loads(await ws.recv())["type"] == "session.created"
            with pytest.raises(websockets.InvalidStatus):
                await websockets.connect(ws_url, subprotocols=["realtime", "openai-insecure-api-key.nope"])
            async with s.async_client(api_key="sekret").realtime.connect(model=MODEL) as conn:
                assert (await conn.recv()).type == "session.created"
                err = await until(conn, "error", timeout_s=10)
                assert err.error.code == "session_idle_timeout"
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await conn.recv()
                assert closed.value.rcvd.code == 1000 and "idle" in closed.value.rcvd.reason
        run(go())
        assert s.metrics()[("omni_realtime_sessions_total", (("outcome", "idle"),))] >= 1

        async def listening():  # a client that only listens to a long response is not idle
            async with s.async_client(api_key="sekret").realtime.connect(model=MODEL) as conn:
                await until(conn, "session.created")
                with held(s, "thinker") as release:
                    seen, task = [], asyncio.ensure_future(_text_turn(conn, "slow"))
                    await asyncio.sleep(1.5)  # three idle timeouts
                    release.set()
                    seen, done = await task
                assert ran_to_its_end(done.response) and "error" not in types(seen)
                # the idle clock starts when the response ends: the client gets the whole period to speak
                ended = time.monotonic()
                err = await until(conn, "error", timeout_s=10)
                assert err.error.code == "session_idle_timeout" and time.monotonic() - ended >= 0.45
        run(listening())


def test_audio_items_and_manual_commit(server):
    """Input audio (manual turns) becomes a user item; clear empties the buffer; commit needs 100 ms."""
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await until(conn, "session.updated")
            audio = pcm16(speech_24k(1.0))
            await conn.input_audio_buffer.append(audio=base64.b64encode(audio[:1000]).decode())
            await conn.input_audio_buffer.clear()
            await until(conn, "input_audio_buffer.cleared")
            await conn.input_audio_buffer.commit(event_id="c1")
            assert (await until(conn, "error")).error.code == "input_audio_buffer_commit_empty"
            for i in range(0, len(audio), 9600):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + 9600]).decode())
            await conn.input_audio_buffer.commit()
            committed = await until(conn, "input_audio_buffer.committed")
            added = await until(conn, "conversation.item.added")
            assert added.item.id == committed.item_id and added.item.content[0].type == "input_audio"
            # an audio item sent whole, after the committed one (previous_item_id), then a response
            await conn.conversation.item.create(previous_item_id=committed.item_id, item={
                "type": "message", "role": "user", "content": [
                    {"type": "input_audio", "audio": base64.b64encode(audio).decode()},
                    {"type": "input_text", "text": "What did I say?"}]})
            added = await until(conn, "conversation.item.added")
            assert added.previous_item_id == committed.item_id
            assert [c.type for c in added.item.content] == ["input_audio", "input_text"]
            await conn.response.create()
            done = await until(conn, "response.done")
            assert ran_to_its_end(done.response) and done.response.usage.input_tokens > 0
    run(go())


def test_speech_on_a_pipeline_without_audio_names_the_model(server):
    """/v1/audio/speech on this text pipeline: a 400 naming `model` (it has no audio output stage)."""
    status, _, body = server.post("/v1/audio/speech", {"model": MODEL, "input": "Hi", "voice": "Chelsie"})
    assert status == 400 and body["error"]["param"] == "model" and "no audio output stage" in body["error"]["message"]
    status, _, body = server.post("/v1/audio/speech", {"model": MODEL, "input": "Hi", "voice": "Chelsie",
                                                       "frobnicate": True})
    assert status == 400 and body["error"]["param"] == "frobnicate" and body["error"]["code"] == "unknown_parameter"
    status, _, body = server.post("/v1/audio/speech", b"input=Hi", headers={"Content-Type": "text/plain"})
    assert status == 415


def test_out_of_band_responses(server):
    """response.conversation "none": a response kept out of the conversation (no conversation.item events, its
    item not retrievable), its metadata echoed, its context the conversation or its own `input` (items and
    references to the conversation's); it runs beside the conversation's response and is cancelled by its id."""
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            seen, first = await _text_turn(conn, "What is the weather like?")
            user_id = seen[0].item.id
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And tomorrow?"}]})
            await until(conn, "conversation.item.done")
            conversation_tokens = None
            for context, label in ((None, "whole"), ([], "empty"), ([{"type": "item_reference", "id": user_id}], "ref"),
                                   ([{"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "A different question?"}]}],
                                    "inline")):
                params = {"conversation": "none", "metadata": {"topic": label}, "instructions": "Classify it.",
                          **({} if context is None else {"input": context})}
                await conn.response.create(response=params)
                events: list = []
                done = await until(conn, "response.done", events)
                assert not any(e.type.startswith("conversation.item") for e in events), types(events)
                created = next(e for e in events if e.type == "response.created")
                assert created.response.metadata == {"topic": label} == done.response.metadata
                assert created.response.conversation_id is None and ran_to_its_end(done.response)
                tokens = done.response.usage.input_tokens
                if label == "whole":
                    conversation_tokens = tokens
                    assert tokens > first.response.usage.input_tokens  # the conversation, the reply included
                else:
                    assert tokens < conversation_tokens, label
                await conn.conversation.item.retrieve(item_id=done.response.output[0].id, event_id=f"r-{label}")
                assert (await until(conn, "error")).error.code == "item_not_found"
            await conn.response.create(event_id="bad-ref", response={"conversation": "none", "input": [
                {"type": "item_reference", "id": "item_nope"}]})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param, err.error.code) == ("bad-ref", "response.input[0].id",
                                                                             "item_not_found")
            await conn.response.create(event_id="bad-item", response={"conversation": "none", "input": [
                {"type": "message", "role": "robot", "content": [{"type": "input_text", "text": "x"}]}]})
            err = await until(conn, "error")
            assert (err.error.event_id, err.error.param) == ("bad-item", "response.input[0].role")

            # beside the conversation's response, and cancelled alone
            with held(server, "thinker") as release:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "wait"}]})
                await conn.response.create()
                main = (await until(conn, "response.created")).response.id
                await conn.response.create(response={"conversation": "none", "instructions": "Summarize."})
                oob = (await until(conn, "response.created")).response.id
                await conn.response.cancel(response_id=oob)
                events = []
                done = await until(conn, "response.done", events)
                assert done.response.id == oob and done.response.status == "cancelled"
                release.set()
                done = await until(conn, "response.done")
            assert done.response.id == main and ran_to_its_end(done.response)
    run(go())
    wait_idle(server)
