"""The POST endpoints take `Content-Type: application/json` only (415, OpenAI-shaped, otherwise; a missing
one too, as vLLM): a browser can POST text/plain or a form to any origin without a CORS preflight, so
without this any web page could drive a local server. In-process on the tiny chain (local backend)."""
from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from omni.async_api import AsyncOmni
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings
from tests.serve.server_utils import CHAIN

pytestmark = pytest.mark.timeout(300)
CHAT = json.dumps({"model": "tiny_chain", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]})
COMPLETION = json.dumps({"model": "tiny_chain", "max_tokens": 2, "prompt": "Hello"})


@pytest.fixture(scope="module")
def omni():
    o = AsyncOmni(CHAIN, backend="local")
    yield o
    o.shutdown()


def send(omni: AsyncOmni, requests: list[tuple[str, str, str | None]]) -> list[httpx2.Response]:
    """(method, path, Content-Type or None for none at all) -> responses, with the JSON body on POSTs."""
    async def main() -> list[httpx2.Response]:
        app = create_app(omni, ServeSettings())
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
            out = []
            for method, path, ctype in requests:
                body = (CHAT if "chat" in path else COMPLETION).encode() if method == "POST" else None
                req = c.build_request(method, path, content=body, timeout=60)
                if ctype is None:
                    req.headers.pop("content-type", None)
                else:
                    req.headers["content-type"] = ctype
                out.append(await c.send(req))
            return out

    return asyncio.run(main())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_only_json_is_accepted(omni, path):
    refused = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
               "application/jsonp"]
    accepted = ["application/json", "Application/JSON; charset=utf-8"]
    responses = send(omni, [("POST", path, c) for c in refused + accepted])
    for ctype, r in zip(refused, responses):
        assert r.status_code == 415, (ctype, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type", err
        assert "application/json" in err["message"], err
    for ctype, r in zip(accepted, responses[len(refused):]):
        assert r.status_code == 200, (ctype, r.text)


def test_get_endpoints_need_no_content_type(omni):
    for r in send(omni, [("GET", "/v1/models", None), ("GET", "/health", "text/plain"), ("GET", "/metrics", None)]):
        assert r.status_code == 200, r.text
