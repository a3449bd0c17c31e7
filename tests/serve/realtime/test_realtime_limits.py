"""`/v1/realtime` under abuse, on the real tiny_chain (two tiny random LMs, max_model_len 256, in this process) with
the `openai` client: a turn longer than the context fails naming the context (not an empty prompt); a session runs at
most --max-session-responses responses, and every realtime response counts against runtime.max_pending_requests as an
HTTP request does (one session cannot starve another client); a conversation holds at most --max-conversation-items
items and --max-conversation-mb; a client gone mid-response ends it `cancelled`, never `failed`; a disconnect frees
the session's slot at once; no `model` in the URL is the server's one model."""
from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
import websockets
import yaml

from omni.serve.realtime import session as session_module
from tests.serve.realtime_utils import ran_to_its_end, until
from tests.serve.server_utils import CHAIN, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(180)
MODEL = "tiny_chain"
TEXT = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 4}
MAX_PENDING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = yaml.safe_load(CHAIN.read_text())
    config["runtime"]["max_pending_requests"] = MAX_PENDING
    path = tmp_path_factory.mktemp("limits") / "tiny_chain.yaml"
    path.write_text(yaml.safe_dump(config))
    with serve_in_process(path, "--backend", "local", "--max-sessions", "3", "--max-session-responses", "2",
                          "--max-conversation-items", "6", "--max-conversation-mb", "1") as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def _session(server):
    conn = await server.async_client().realtime.connect(model=MODEL).enter()
    await until(conn, "session.created")
    await conn.session.update(session=TEXT)
    await until(conn, "session.updated")
    return conn


async def _item(conn, text: str) -> object:
    """conversation.item.create of a user text item: its conversation.item.done, or the error event."""
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    while True:
        ev = await asyncio.wait_for(conn.recv(), 30)
        if ev.type in ("conversation.item.done", "error"):
            return ev


async def _turn(conn, text: str) -> object:
    assert (await _item(conn, text)).type == "conversation.item.done"
    await conn.response.create()
    return (await until(conn, "response.done")).response


def test_a_turn_longer_than_the_context_names_the_context(server):
    async def go():
        conn = await _session(server)
        try:
            assert ran_to_its_end(await _turn(conn, "Hello there"))
            # ~3,000 tokens against the thinker's 256: truncation ("auto") drops the earlier turns, then cannot drop
            # the item itself. The error is the context's, with its numbers, not "an empty prompt".
            big = await _item(conn, "word " * 2500)
            await conn.response.create()
            seen: list = []
            done = (await until(conn, "response.done", seen)).response
            assert done.status == "failed"
            err = next(e for e in seen if e.type == "error").error
            assert (err.code, err.param) == ("context_length_exceeded", "conversation"), err
            assert "256" in err.message and "newest item alone" in err.message, err.message
            # the session goes on: without the big item, the conversation (earlier turns kept) answers again
            await conn.conversation.item.delete(item_id=big.item.id)
            await until(conn, "conversation.item.deleted")
            await conn.response.create()
            again = (await until(conn, "response.done")).response
            assert ran_to_its_end(again), again.status_details
            assert again.usage.input_tokens > 5  # the first turn and its reply are still in the prompt
        finally:
            await conn.close()
    run(go())


def test_responses_per_session_and_the_servers_admission_are_bounded(server):
    async def go():
        a, b, c = [await _session(server) for _ in range(3)]
        try:
            for conn in (a, b):
                assert (await _item(conn, "Hi")).type == "conversation.item.done"
            with held(server, "thinker"):
                for conn in (a, b):  # two out-of-band responses each: the server's 4 pending requests
                    for _ in range(2):
                        await conn.response.create(response={"conversation": "none"})
                        await until(conn, "response.created")
                # a third in one session: its own bound, named
                await a.response.create(response={"conversation": "none"})
                err = (await until(a, "error")).error
                assert err.code == "session_response_limit" and "--max-session-responses 2" in err.message, err
                status, _, body = server.get("/health")
                assert status == 200 and body["pending_requests"] == MAX_PENDING
                # another session and an HTTP client meet the server's admission (runtime.max_pending_requests)
                await c.response.create(response={"conversation": "none", "input": [], "instructions": "Hi"})
                err = (await until(c, "error")).error
                assert (err.type, err.code) == ("server_error", "overloaded") and str(MAX_PENDING) in err.message
                status, _, _ = server.post("/v1/chat/completions", {
                    "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
                assert status == 503
            for conn in (a, b):
                for _ in range(2):
                    assert ran_to_its_end((await until(conn, "response.done")).response)
            assert server.get("/health")[2]["pending_requests"] == 0
            # c was refused, not broken: it answers now
            await c.response.create(response={"conversation": "none", "input": [], "instructions": "Hi"})
            assert ran_to_its_end((await until(c, "response.done")).response)
        finally:
            for conn in (a, b, c):
                await conn.close()
    run(go())
    wait_idle(server)


def test_the_conversation_is_bounded_in_items_and_bytes(server):
    async def go():
        conn = await _session(server)
        try:
            ids = [(await _item(conn, f"item {i}")).item.id for i in range(6)]
            err = (await _item(conn, "one more")).error
            assert err.code == "conversation_too_large" and "--max-conversation-items 6" in err.message, err
            await conn.conversation.item.delete(item_id=ids[0])
            await until(conn, "conversation.item.deleted")
            assert (await _item(conn, "room again")).type == "conversation.item.done"
        finally:
            await conn.close()
        conn = await _session(server)
        try:
            assert (await _item(conn, "x" * 600_000)).type == "conversation.item.done"
            err = (await _item(conn, "y" * 600_000)).error
            assert err.code == "conversation_too_large" and "--max-conversation-mb 1" in err.message, err
            await conn.response.create(response={"max_output_tokens": 1, "conversation": "none", "input": [],
                                                 "instructions": "Still serving?"})
            assert ran_to_its_end((await until(conn, "response.done")).response)
        finally:
            await conn.close()
    run(go())


def test_a_client_gone_mid_response_ends_it_cancelled_not_failed(server, monkeypatch, caplog):
    """The response sends to a socket its client closed before the session saw the close (its handler was busy
    with an earlier event): that is the client leaving, not the pipeline failing."""
    busy = threading.Event()
    handled = threading.Event()

    async def slow_clear(self, ev):  # an event whose handling outlasts the client
        handled.set()
        await asyncio.to_thread(busy.wait, 30)

    monkeypatch.setattr(session_module.Session, "_on_input_audio_buffer_clear", slow_clear)
    before = server.metrics()

    async def go():
        with held(server, "thinker") as release:
            conn = await _session(server)
            assert (await _item(conn, "Hello")).type == "conversation.item.done"
            await conn.response.create()
            await until(conn, "response.created")
            await conn.input_audio_buffer.clear()
            await asyncio.to_thread(handled.wait, 30)
            await conn.close()
            release.set()  # the reply streams to a socket that is gone
            await asyncio.sleep(1.0)
        busy.set()

    with caplog.at_level(logging.ERROR):
        run(go())
    wait_idle(server)
    after = server.metrics()
    key = lambda status: ("omni_realtime_turns_total", (("status", status),))  # noqa: E731
    assert after.get(key("failed"), 0) == before.get(key("failed"), 0)
    assert after[key("cancelled")] == before.get(key("cancelled"), 0) + 1
    assert not [r for r in caplog.records if "realtime response" in r.getMessage()]


@pytest.mark.slow
def test_a_disconnect_frees_the_slot_at_once_and_no_model_is_the_servers(server, monkeypatch):
    """A session whose handler is still busy (a VAD that loads) when its client leaves frees its slot at once:
    a client reconnecting then is not refused with 1013."""
    busy = threading.Event()
    handled = threading.Event()

    async def slow_clear(self, ev):
        handled.set()
        await asyncio.to_thread(busy.wait, 30)

    monkeypatch.setattr(session_module.Session, "_on_input_audio_buffer_clear", slow_clear)

    async def go():
        client = server.async_client()
        conns = [await _session(server) for _ in range(3)]  # --max-sessions 3
        await conns[0].input_audio_buffer.clear()
        await asyncio.to_thread(handled.wait, 30)
        await conns[0].close()
        for _ in range(200):  # the server sees the close on its own time, not when the handler is done
            if server.metrics()[("omni_realtime_sessions_open", ())] == 2:
                break
            await asyncio.sleep(0.02)
        again = await client.realtime.connect(model=MODEL).enter()
        assert (await again.recv()).type == "session.created"
        busy.set()
        for conn in (again, *conns[1:]):
            await conn.close()
        # no ?model= (vLLM-Omni's clients name it in session.update): the server's one model
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime") as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created" and created["session"]["model"] == MODEL
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "model": MODEL}}))
            assert json.loads(await ws.recv())["type"] == "session.updated"
    run(go())


def test_an_unknown_websocket_route_is_a_missing_route(server):
    async def go():
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(server.url.replace("http", "ws") + "/v1/audio/speech/stream"):
                pass
        response = refused.value.response
        assert response.status_code == 404
        err = json.loads(response.body)["error"]
        assert err["code"] == "not_found" and "/v1/audio/speech/stream" in err["message"], err
    run(go())
