"""`GET /v1/realtime?model=NAME` upgraded to a WebSocket: one Realtime session per connection
(realtime/session.py holds the protocol; this file the socket and the limits around it).

    handshake   the same bearer check as HTTP (--api-key; a browser, which cannot set headers, may send
                the key as the subprotocol `openai-insecure-api-key.KEY` next to `realtime`, as OpenAI's
                endpoint takes it): refused with 401 (403 where the server cannot send a body with a
                refused upgrade); while the server drains, 503 the same way
    accepted    a wrong `model` is an `error` event naming it, then close 1008 (none: the server's one model, which
                session.update may name); past --max-sessions an
                `error` event, then close 1013 (try again later); else `session.created`
    serving     every client message -> Session.handle, in order (a refused event is an `error` event: the
                session goes on; a reader task reads ahead, at most INBOX messages); server events are sent
                one at a time (one lock: a response's deltas and the answers to client events never
                interleave inside a frame)
    idle        no client event for --session-idle-timeout-s and no response running: an `error` event
                saying so, close 1000
    draining    (http/shutdown.py) a response in progress counts as in flight: it may finish within the
                grace period; a new one is refused with an `error` event (code shutting_down)
    shut down   once the drain is over (grace period out, or nothing left in flight): the response still
                running is cancelled (response.done, reason shutting_down), an `error` event (code
                shutting_down), close 1001 (going away)
    end         the client closes or disconnects, or the server shuts down: the session's slot is free at
                once; the response in progress is cancelled (status cancelled, never failed: a send to a
                gone client raises ClientGone), its request aborted on every stage (their blocks freed)
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omni.serve.http.errors import ApiError
from omni.serve.realtime.hub import ClientGone, RealtimeHub
from omni.serve.realtime.session import Session

logger = logging.getLogger(__name__)
CLOSE_POLICY = 1008  # a wrong model: retrying the same request cannot help
CLOSE_TRY_AGAIN = 1013
CLOSE_GOING_AWAY = 1001
INBOX = 64  # client messages read ahead of the session


BROWSER_KEY_PREFIX = "openai-insecure-api-key."  # browsers cannot set headers: the key as a subprotocol


def _authorized(ws: WebSocket, key: str | None) -> bool:
    """`Authorization: Bearer KEY`, or (a browser's WebSocket) the subprotocol `openai-insecure-api-key.KEY`."""
    if key is None:
        return True
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    tokens = [token.strip()] if scheme.lower() == "bearer" else []
    tokens += [p.removeprefix(BROWSER_KEY_PREFIX) for p in ws.scope.get("subprotocols", [])
               if p.startswith(BROWSER_KEY_PREFIX)]
    return any(hmac.compare_digest(t.encode(), key.encode()) for t in tokens)


async def deny(ws: WebSocket, err: ApiError) -> None:
    """Refuse the upgrade with an HTTP answer (its body where the server can send one)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(err.body(), status_code=err.status))
    else:
        await ws.close(code=CLOSE_POLICY, reason=err.message[:120])


async def _close_with_error(ws: WebSocket, code: int, message: str, param: str | None, err_code: str) -> None:
    body = {"type": "error", "event_id": f"event_{uuid.uuid4().hex[:24]}", "error": {"type": "invalid_request_error",
                                                                  "code": err_code, "message": message,
                                                                  "param": param, "event_id": None}}
    await ws.send_text(json.dumps(body))
    await ws.close(code=code, reason=message[:120])


async def _close_when_stopped(hub: RealtimeHub, session: Session, ws: WebSocket) -> None:
    """Once the server's drain is over, end the session: its response cancelled, an error event, close 1001
    (the receive loop then sees the socket closed)."""
    await hub.drain.stopping.wait()
    await session.cancel_all("shutting_down")
    with contextlib.suppress(Exception):  # the client may be gone already
        await session.error("the server is shutting down", None, "shutting_down", kind="server_error")
        await ws.close(code=CLOSE_GOING_AWAY, reason="the server is shutting down")


async def _read(ws: WebSocket, inbox: asyncio.Queue[dict[str, Any] | None], gone: Callable[[], None]) -> None:
    """The socket's messages into `inbox` (bounded: a client that sends faster than its session handles waits on
    its own socket), then None once it closes. A disconnect frees the session's slot at once (`gone`), even while
    the session still handles an event (a VAD that loads): a client reconnecting at once is not refused."""
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            await inbox.put(message)
    except Exception:  # noqa: BLE001 - a transport error ends the socket as a disconnect does
        pass
    finally:
        gone()
    await inbox.put(None)


async def realtime_endpoint(hub: RealtimeHub, ws: WebSocket) -> None:
    settings = hub.settings
    if not _authorized(ws, settings.api_key):
        await deny(ws, ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key"))
        return
    if hub.drain.draining or hub.omni.closed:
        await deny(ws, ApiError(503, "the server is shutting down", type="server_error", code="shutting_down"))
        return
    # A browser asks for the `realtime` subprotocol (with its key as another): the handshake must name one
    await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", []) else None)
    # The server serves one model: a client that names it in session.update only (vLLM-Omni's) gets it
    model = ws.query_params.get("model") or hub.info.model
    if model != hub.info.model:
        hub.realtime_metrics.sessions.labels(outcome="refused").inc()
        await _close_with_error(ws, CLOSE_POLICY, f"The model `{model}` does not exist (this server serves "
                                f"`{hub.info.model}`).", "model", "model_not_found")
        return
    if len(hub.sessions) >= settings.max_sessions:
        hub.realtime_metrics.sessions.labels(outcome="refused").inc()
        await _close_with_error(ws, CLOSE_TRY_AGAIN, f"the server runs {len(hub.sessions)} realtime sessions, its "
                                "limit (--max-sessions); try again later", None, "session_limit_reached")
        return
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        text = json.dumps(event, separators=(",", ":"))
        async with lock:
            try:
                await ws.send_text(text)
            except Exception as e:  # noqa: BLE001 - disconnected, closed, or a transport error: the client is gone
                raise ClientGone(f"the client is gone: {type(e).__name__}") from e

    session = Session(hub, send, hub.info.model)
    hub.sessions.add(session)
    hub.realtime_metrics.open.inc()
    outcome = "closed"
    closer = asyncio.create_task(_close_when_stopped(hub, session, ws))
    inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(INBOX)
    reader = asyncio.create_task(_read(ws, inbox, lambda: hub.sessions.discard(session)))
    try:
        await session.start()
        idle_s = settings.session_idle_timeout_s
        last_event = time.monotonic()
        while True:
            # idle: no client event, and nothing running, for idle_s (counted from whichever ended last)
            quiet = max(last_event, session.quiet_since)
            timeout = idle_s if session.busy else idle_s - (time.monotonic() - quiet)
            try:
                message = await asyncio.wait_for(inbox.get(), max(timeout, 0.01))
            except asyncio.TimeoutError:
                quiet = max(last_event, session.quiet_since)
                if session.busy or time.monotonic() - quiet < idle_s:  # listening to a response, or not yet
                    continue
                outcome = "idle"
                reason = f"no client event for {settings.session_idle_timeout_s:g} s (--session-idle-timeout-s)"
                await session.cancel_response("session_idle")
                with contextlib.suppress(Exception):
                    await session.error(f"the session is closed: {reason}", None, "session_idle_timeout")
                    await ws.close(code=1000, reason=reason[:120])
                break
            last_event = time.monotonic()
            if message is None:  # the socket is gone (the reader freed the session's slot already)
                break
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            await session.handle(data)
    except (WebSocketDisconnect, ClientGone):
        pass
    except Exception:  # noqa: BLE001 - a bug ends this session, not the server
        outcome = "error"
        logger.exception("realtime session %s failed", session.id)
        with contextlib.suppress(Exception):
            if ws.application_state == WebSocketState.CONNECTED:
                await ws.close(code=1011, reason="internal error")
    finally:
        for task in (closer, reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()
        hub.sessions.discard(session)
        hub.realtime_metrics.open.dec()
        hub.realtime_metrics.sessions.labels(outcome=outcome).inc()
