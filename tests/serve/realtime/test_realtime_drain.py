"""`/v1/realtime` while `omni serve` shuts down (the drain SIGTERM starts, omni/serve/http/shutdown.py), on the tiny
Qwen2.5-Omni in this process: a response in progress counts as in flight and may finish within the grace
period, a session asking for a new one meanwhile gets an `error` event (shutting_down), and once the drain
is over every session gets an `error` event and a close 1001 (going away); past the grace period the
response still running is cancelled (reason shutting_down) and its request aborted on every stage. A
response that must still be running is held (`held`), never assumed slow enough. Each test drains its own
server."""
from __future__ import annotations

import asyncio

import pytest
import websockets

from tests.serve.realtime_utils import ran_to_its_end, until
from tests.serve.server_utils import OMNI, generating, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}, "output": {"voice": "Chelsie"}}}


@pytest.fixture
def server():
    with serve_in_process(OMNI, "--backend", "local", "--audio-chunk-ms", "20") as s:
        yield s


async def _connect(server):
    conn = await server.async_client().realtime.connect(model=MODEL).enter()
    await until(conn, "session.created")
    await conn.session.update(session=MANUAL)
    await until(conn, "session.updated")
    return conn


async def _ask(conn, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create()


async def _closed(conn, seen: list) -> int:
    """Read events until the server closes the socket; the close code."""
    try:
        while True:
            seen.append(await asyncio.wait_for(conn.recv(), 60))
    except websockets.exceptions.ConnectionClosed as e:
        return e.rcvd.code if e.rcvd is not None else -1


async def _wait(future, timeout_s: float = 60) -> bool:
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)


def test_a_response_in_progress_finishes_new_ones_are_refused_then_sessions_close(server):
    async def go():
        busy, idle = await _connect(server), await _connect(server)
        seen_busy: list = []
        with held(server, "talker", until=generating(1)) as release:
            await _ask(busy, "Hello")
            await until(busy, "response.created", seen_busy)
            drained = server.drain(grace_s=120)
            while not server.app.state.omni.drain.draining:
                await asyncio.sleep(0.01)
            # Draining: the idle session may not start a response.
            await _ask(idle, "Hi")
            refused = await until(idle, "error")
            assert refused.error.code == "shutting_down"
            assert not drained.done()  # the held response is still in flight
            release.set()
        done = await until(busy, "response.done", seen_busy)
        assert ran_to_its_end(done.response)
        assert [e for e in seen_busy if e.type == "response.output_audio.delta"]
        assert await _wait(drained) is True  # everything finished within the grace period
        for conn in (busy, idle):
            rest: list = []
            assert await _closed(conn, rest) == 1001
            assert [e.error.code for e in rest if e.type == "error"] == ["shutting_down"]
            assert not [e for e in rest if e.type == "response.created"]
    asyncio.run(go())
    wait_idle(server)


def test_past_the_grace_period_the_response_is_cancelled_and_the_session_closed(server):
    async def go():
        conn = await _connect(server)
        seen: list = []
        with held(server, "talker", until=generating(1)):
            await _ask(conn, "Tell me a long story.")
            await until(conn, "response.created", seen)
            drained = server.drain(grace_s=0.5)
            done = await until(conn, "response.done", seen)
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "shutting_down"
            rest: list = []
            assert await _closed(conn, rest) == 1001
            assert [e.error.code for e in rest if e.type == "error"] == ["shutting_down"]
            assert await _wait(drained) is False  # the response had to be ended
    asyncio.run(go())
    wait_idle(server)  # the cancelled request was aborted on every stage
