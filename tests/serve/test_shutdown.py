"""Shutdown: new requests get 503, those in flight finish within the grace period, the ones left then end
with an error (a stream: an error event and [DONE]), and only then does the pipeline close.

The drain itself in-process (httpx's ASGI transport, tiny chain on the local backend); the signal path
through the real `omni serve` command run in this process (`omni.cli.main`, uvicorn's signal handlers in
the main thread) and a real SIGTERM: a stream in flight that finishes within --shutdown-grace-s (exit 0),
and one that cannot (exit 143). A request that "cannot finish" is one whose stage is held (`held`), never
one assumed long enough for this machine's speed.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import httpx2
import pytest

from omni import async_api as async_api_module
from omni.async_api import AsyncOmni
from omni.cli import main as omni_main
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings
from tests.procs import free_ports
from tests.serve.server_utils import CHAIN, generating, held

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
        first_tokens = lambda: state.metrics.registry.get_sample_value(  # noqa: E731
            "omni_time_to_first_token_seconds_count", {"stage": "thinker"}) or 0
        # Both generating (their first token out: the stream's status line went out), then the thinker
        # is held: neither can finish, whatever this machine's speed.
        with held(omni, "thinker", until=generating(2)):
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
                streamed = asyncio.ensure_future(c.post(PATH, json=body(200, True), timeout=60))
                whole = asyncio.ensure_future(c.post(PATH, json=body(200, False), timeout=60))
                await _until(lambda: first_tokens() == 2)
                t0 = time.monotonic()
                assert await state.drain.drain(0.2) is False
                # ended at once (its 0.2 s grace, then at most drain's END_TIMEOUT_S), not never
                assert time.monotonic() - t0 < 30
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


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _post(url: str, payload: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _serve_and_sigterm(monkeypatch: pytest.MonkeyPatch, grace_s: float, release_after_signal: bool) -> dict:
    """`omni serve` (the CLI's own code, in this process's main thread, so uvicorn installs its signal
    handlers) with one stream in flight whose thinker is held after its first token; a real SIGTERM to
    this process once the stream is open; with `release_after_signal` the thinker goes on once the drain
    has begun (the stream then finishes within the grace period), else it stays held (it cannot)."""
    made: list[AsyncOmni] = []

    class Recorded(AsyncOmni):  # the server builds its own pipeline: keep a handle to hold its thinker
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(async_api_module, "AsyncOmni", Recorded)
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, Any] = {}

    def client() -> None:
        try:
            deadline = time.monotonic() + 240
            while not made or _health(url) != 200:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            with held(made[0], "thinker", until=generating(1)) as release:
                req = urllib.request.Request(url + PATH, data=json.dumps(body(200, True)).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    first = r.readline().decode()  # streaming: the thinker is held after this token
                    os.kill(os.getpid(), signal.SIGTERM)
                    deadline = time.monotonic() + 60
                    while _health(url) != 503:  # draining: still listening, answering 503
                        assert time.monotonic() < deadline, "no drain after SIGTERM"
                        time.sleep(0.02)
                    seen["late"] = _post(url + PATH, body(2, False))
                    if release_after_signal:
                        release.set()
                    seen["stream"] = first + r.read().decode()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            seen["error"] = e

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    seen["exit"] = omni_main(["serve", str(CHAIN), "--backend", "local", "--port", str(port),
                              "--shutdown-grace-s", str(grace_s)])
    thread.join(60)
    assert "error" not in seen, repr(seen.get("error"))
    status, late = seen["late"]
    assert status == 503 and json.loads(late)["error"]["code"] == "shutting_down", late
    return seen


def _health(url: str) -> int | None:
    try:
        return _get(url + "/health")[0]
    except OSError:  # not listening yet
        return None


@pytest.mark.slow
def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(monkeypatch, capsys):
    seen = _serve_and_sigterm(monkeypatch, grace_s=120, release_after_signal=True)
    events = sse_events(seen["stream"])
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-3:]
    assert seen["exit"] == 0
    assert "SIGTERM: draining" in capsys.readouterr().err


def test_sigterm_past_the_grace_period_ends_the_stream_with_an_error_and_exits_143(monkeypatch, capsys):
    seen = _serve_and_sigterm(monkeypatch, grace_s=0.5, release_after_signal=False)
    events = sse_events(seen["stream"])
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
    assert seen["exit"] == 143
    assert "the grace period (0.5 s) ran out" in capsys.readouterr().err
