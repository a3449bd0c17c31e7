"""The server's edge, as one ASGI middleware: API key, body size, and the HTTP status count.

- `/v1/*` requires `Authorization: Bearer <key>` when an API key is set (constant-time comparison;
  401 otherwise). /health and /metrics stay open (probes and scrapers), as in vLLM.
- A body larger than `max_body_bytes` is refused with 413 before the app sees it: by its
  Content-Length when it has one, else while it is read (chunked uploads are counted too).
- Every answer is counted by path and status (`omni_http_requests_total`).
"""
from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni.serve.errors import ApiError, too_large
from omni.serve.metrics import ServerMetrics

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


async def send_error(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self._handle(scope, receive, counted_send)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            code = str(status[0]) if status else "499"  # nothing sent: the client left first
            self.metrics.http.labels(path=path, status=code).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1/") and not self._authorized(headers):
            await send_error(send, ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer "
                                            "<key>`.", param=None, code="invalid_api_key"))
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
