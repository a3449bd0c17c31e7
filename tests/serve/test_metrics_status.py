"""`omni_http_requests_total` counts every response once, with the status the client got: a 500 from an
unexpected exception (it used to be counted 499: the handler that answered it sat outside the counting
middleware), an error the middleware answers before any route, and a stream that fails midway (200: its
status line went out before the failure, which is an error event). In-process on the tiny chain (local backend)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni.async_api import AsyncOmni
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings
from tests.serve.server_utils import CHAIN

pytestmark = pytest.mark.timeout(300)
PATH = "/v1/chat/completions"
BODY = {"model": "tiny_chain", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def omni():
    o = AsyncOmni(CHAIN, backend="local")
    yield o
    o.shutdown()


def statuses(text: str) -> dict[tuple[str, str], float]:
    return {(s.labels["path"], s.labels["status"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "omni_http_requests_total"}


def run(omni: AsyncOmni, requests: list[dict[str, Any]]) -> tuple[list[httpx2.Response], dict]:
    """POST each body (or the given raw request) to a fresh app; (responses, the status counts after)."""
    async def main() -> tuple[list[httpx2.Response], dict]:
        app = create_app(omni, ServeSettings())
        transport = httpx2.ASGITransport(app=app)  # raises what the app lets escape: nothing may
        async with httpx2.AsyncClient(transport=transport, base_url="http://omni") as c:
            out = [await c.post(PATH, timeout=60, **r) for r in requests]
            return out, statuses((await c.get("/metrics")).text)

    return asyncio.run(main())


def test_unexpected_exception_is_counted_500(omni, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the pipeline")

    monkeypatch.setattr(omni, "stream", broken)
    (r,), counts = run(omni, [{"json": BODY}])
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "RuntimeError" in err["message"] and "Traceback" not in r.text
    assert counts == {(PATH, "500"): 1.0}, counts


def test_edge_errors_and_successes_are_counted_once(omni):
    rs, counts = run(omni, [{"json": BODY}, {"content": b"{}", "headers": {"content-type": "text/plain"}},
                            {"json": {"model": "nope", "messages": []}}])
    assert [r.status_code for r in rs] == [200, 415, 400]
    assert counts == {(PATH, "200"): 1.0, (PATH, "415"): 1.0, (PATH, "400"): 1.0}, counts


def test_stream_failing_midway_is_counted_once_as_sent(omni, monkeypatch):
    real = omni.stream

    def fails_after_first(*args: Any, **kwargs: Any) -> Any:
        async def gen() -> Any:
            agen = real(*args, **kwargs)
            try:
                yield await agen.__anext__()
                raise RuntimeError("the pipeline broke midway")
            finally:
                await agen.aclose()
        return gen()

    monkeypatch.setattr(omni, "stream", fails_after_first)
    (r,), counts = run(omni, [{"json": {**BODY, "stream": True}}])
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error", events
    assert counts == {(PATH, "200"): 1.0}, counts


def test_every_route_is_counted_by_its_own_path(omni):
    """The speech-to-text routes and a model's own page are counted under their paths, not "other" (which is
    left for routes this server does not have); `client.models.retrieve` gets the model or a 404 naming it."""
    async def main() -> tuple[list[httpx2.Response], dict]:
        app = create_app(omni, ServeSettings())
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
            out = [await c.get("/v1/models/tiny_chain"), await c.get("/v1/models/gpt-4o"),
                   await c.post("/v1/audio/transcriptions", json={}), await c.post("/v1/audio/translations", json={}),
                   await c.get("/v1/embeddings")]
            return out, statuses((await c.get("/metrics")).text)

    rs, counts = asyncio.run(main())
    assert [r.status_code for r in rs] == [200, 404, 415, 415, 404]
    assert {k: rs[0].json()[k] for k in ("id", "object", "owned_by")} == {"id": "tiny_chain", "object": "model",
                                                                          "owned_by": "omni"}
    assert rs[1].json()["error"]["param"] == "model" and rs[1].json()["error"]["code"] == "model_not_found"
    assert counts == {("/v1/models/{model}", "200"): 1.0, ("/v1/models/{model}", "404"): 1.0,
                      ("/v1/audio/transcriptions", "415"): 1.0, ("/v1/audio/translations", "415"): 1.0,
                      ("other", "404"): 1.0}, counts
