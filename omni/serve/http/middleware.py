"""The server's one ASGI middleware, around every route: API key, content type, body size, shutdown,
the HTTP status count, and the last word on unexpected errors.

- `/v1/*` (and vLLM's /tokenize, /detokenize, /version) requires `Authorization: Bearer <key>` when an API key
  is set (constant-time comparison; 401 otherwise). /health, /ping and /metrics stay open (probes and
  scrapers), as in vLLM.
- The POST endpoints take `Content-Type: application/json` only (415 otherwise, a missing one too, as
  vLLM): a browser sends text/plain or a form to any origin without a CORS preflight, JSON it does not.
- A body larger than `max_body_bytes` is refused with 413 before the app sees it: by its
  Content-Length when it has one, else while it is read (chunked uploads are counted too).
- While the server drains (http/shutdown.py), new `/v1/*` requests are answered 503 `shutting_down`.
- An exception nothing else handled is a 500 that names its type (logged here, never a traceback to
  the client); one raised after the response started (a stream) ends the connection.
- Every answer is counted once by path and the status the client got (`omni_http_requests_total`),
  whether the app, this middleware or the 500 above sent it; 499 when none was sent (the client left).
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni.serve.http.errors import ApiError, internal, too_large
from omni.serve.http.metrics import ServerMetrics
from omni.serve.http.shutdown import Drain, shutting_down

logger = logging.getLogger(__name__)
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/audio/transcriptions",
         "/v1/audio/translations", "/v1/realtime", "/v1/models", "/health", "/metrics", "/ping", "/tokenize",
         "/detokenize", "/version")
JSON_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/tokenize", "/detokenize")
GUARDED_OUTSIDE_V1 = ("/tokenize", "/detokenize", "/version")  # the API's too: the key guards them, drains them


def _api_path(path: str) -> bool:
    return path.startswith("/v1/") or path in GUARDED_OUTSIDE_V1


async def send_error(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ServerMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics,
                 drain: Drain):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        self.drain.enter()
        try:
            await self._handle(scope, receive, counted_send)
        except Exception as e:
            if status:  # the status line is gone (a stream): it stands, and the connection ends
                raise
            logger.exception("unexpected error on %s %s", scope.get("method"), scope["path"])
            await send_error(counted_send, internal(f"the server failed on this request ({type(e).__name__}); "
                                                    "see its log"))
        finally:
            self.drain.leave()
            path = scope["path"]
            path = path if path in PATHS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
            code = str(status[0]) if status else "499"  # nothing sent: the client left first
            self.metrics.http.labels(path=path, status=code).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and _api_path(scope["path"]) and not self._authorized(headers):
            await send_error(send, ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer "
                                            "<key>`.", param=None, code="invalid_api_key"))
            return
        if self.drain.draining and _api_path(scope["path"]):
            await send_error(send, shutting_down("it answers the requests in flight and takes no new ones"))
            return
        if scope["method"] == "POST" and scope["path"] in JSON_POSTS:
            ctype = headers.get("content-type", b"").decode("latin-1")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                got = f"got {ctype!r}" if ctype else "no Content-Type was sent"
                await send_error(send, ApiError(415, f"Unsupported Media Type: only 'application/json' is allowed "
                                                f"({got})", code="unsupported_media_type"))
                return
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(send, too_large(f"the request body is {int(length)} bytes, more than the server's "
                                             f"limit of {limit} (--max-body-mb)"))
            return
        # Read the body here (bounded), then hand the app a receive that replays it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > limit:
                await send_error(send, too_large(f"the request body is more than the server's limit of "
                                                 f"{limit} bytes (--max-body-mb)"))
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, Any]) -> bool:
        value: bytes = headers.get("authorization", b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest on equal-type bytes: the time does not depend on where they differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
