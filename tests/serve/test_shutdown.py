"""Shutdown: new requests get 503, those in flight finish within the grace period, the ones left then end
with an error (a stream: an error event and [DONE]), and only then does the pipeline close.

The drain itself in-process (httpx's ASGI transport, tiny chain on the local backend); the signal path
once on a real `omni serve`: SIGTERM with one stream that finishes within --shutdown-grace-s and one that
does not (exit 143; 0 would mean nothing had to be cut).
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request
from typing import Any

import httpx2
import pytest

from omni.async_api import AsyncOmni
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings
from tests.serve.server_utils import CHAIN, omni_serve

pytestmark = pytest.mark.timeout(300)
PATH = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny_chain", "messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.fixture(scope="module")
def omni():
    o = AsyncOmni(CHAIN, backend="local")
    yield o
    o.shutdown()


async def _until(cond: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_drain_lets_requests_in_flight_finish_and_refuses_new_ones(omni):
    async def main() -> None:
        app = create_app(omni, ServeSettings())
        state = app.state.omni
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
            streamed = asyncio.ensure_future(c.post(PATH, json=body(40, True), timeout=60))
            whole = asyncio.ensure_future(c.post(PATH, json=body(40, False), timeout=60))
            await _until(lambda: state.pending == 2)
            drained = asyncio.ensure_future(state.drain.drain(60))
            await _until(lambda: state.drain.draining)
            late, health = await c.post(PATH, json=body(2, False)), await c.get("/health")
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
            assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
            assert (await c.get("/metrics")).status_code == 200  # scrapes go on
            assert await drained is True
            s, w = await streamed, await whole
        events = sse_events(s.text)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert w.status_code == 200 and w.json()["usage"]["completion_tokens"] == 40, w.text
        assert state.pending == 0 and state.drain.in_flight == 0

    asyncio.run(main())


def test_grace_period_over_ends_each_request_with_an_error(omni):
    async def main() -> None:
        app = create_app(omni, ServeSettings())
        state = app.state.omni
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
            streamed = asyncio.ensure_future(c.post(PATH, json=body(200, True), timeout=60))
            whole = asyncio.ensure_future(c.post(PATH, json=body(200, False), timeout=60))
            # both generating (their first token seen): the stream's status line went out
            first_tokens = lambda: state.metrics.registry.get_sample_value(  # noqa: E731
                "omni_time_to_first_token_seconds_count", {"stage": "thinker"}) or 0
            await _until(lambda: first_tokens() == 2)
            t0 = time.monotonic()
            assert await state.drain.drain(0.2) is False
            assert time.monotonic() - t0 < 5  # ended at once, not after their 200 tokens
            s, w = await streamed, await whole
        events = sse_events(s.text)
        assert s.status_code == 200 and events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
        assert w.status_code == 503 and w.json()["error"]["code"] == "shutting_down", w.text
        assert state.pending == 0 and state.drain.in_flight == 0
        # both runs were aborted on every stage: the pipeline holds nothing of them
        deadline = time.monotonic() + 30
        while (await omni.stats())["requests"]["in_flight"]:
            assert time.monotonic() < deadline, await omni.stats()
            await asyncio.sleep(0.05)

    asyncio.run(main())


def test_sigterm_drains_a_live_server():
    """One stream finishes within the grace period, one cannot; the server exits 143 once both ended."""
    overrides = json.dumps({s: {"scheduler": {"max_model_len": 2048}, "cache": {"num_blocks": 700}}
                            for s in ("thinker", "talker")})
    with omni_serve(CHAIN, "--backend", "local", "--shutdown-grace-s", "5", "--stage-overrides", overrides) as srv:
        started = {"short": threading.Event(), "long": threading.Event()}
        texts: dict[str, str] = {}

        def stream(name: str, max_tokens: int) -> None:
            req = urllib.request.Request(srv.url + PATH, data=json.dumps(body(max_tokens, True)).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    first = r.readline().decode()
                    started[name].set()
                    texts[name] = first + r.read().decode()
            except Exception as e:  # noqa: BLE001 - reported by the assertions below
                texts[name] = f"{type(e).__name__}: {e}"
                started[name].set()

        # ~6 ms a token on this machine's CPU (~70 ms with 7 jobs on its 2 cores): 20 tokens end well within
        # 5 s, 2000 do not. The short one starts last, and the signal goes as soon as it streams.
        threads = {name: threading.Thread(target=stream, args=(name, n))
                   for name, n in (("long", 2000), ("short", 20))}
        for name, t in threads.items():
            t.start()
            assert started[name].wait(120)
        assert "long" not in texts, texts  # streaming
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while srv.get("/health")[0] != 503:  # draining: still listening, answering 503
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, _, late = srv.post(PATH, body(2, False))
        assert status == 503 and late["error"]["code"] == "shutting_down", late
        assert srv.proc.wait(timeout=60) == 143
        took = time.monotonic() - t0
        for t in threads.values():
            t.join(timeout=30)
    short, long = sse_events(texts["short"]), sse_events(texts["long"])
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short[-3:]
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "shutting_down", long[-3:]
    assert 5 <= took < 40, took
