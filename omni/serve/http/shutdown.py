"""Graceful shutdown of one app: stop admitting, let what is in flight finish, end what is left.

    drain = Drain()                       # the middleware counts every HTTP request in flight through it
    clean = await drain.drain(grace_s)    # the CLI calls it on SIGTERM / Ctrl-C, then closes the pipeline

Once `drain` starts, new `/v1/*` requests are answered 503 `shutting_down` (and /health 503); requests
already in flight run on for up to `grace_s`. If some are still running then, `stopping` is set: each
open stream sends an error event (`shutting_down`) and `[DONE]`, and a non-streamed request still
waiting is answered 503 `shutting_down`. `drain` returns once no response is in flight: True when
everything finished within the grace period; `stopping` is set then either way (a Realtime session,
which outlives its responses, closes on it). The server's own code ends the streams, so the drain
does not depend on how the ASGI server (uvicorn) or sse-starlette treat open connections at exit.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio

from omni.serve.http.errors import ApiError

T = TypeVar("T")
END_TIMEOUT_S = 10.0  # once `stopping` is set every response ends at once; a bound on waiting for it


def shutting_down(message: str) -> ApiError:
    return ApiError(503, f"the server is shutting down: {message}", type="server_error", code="shutting_down")


class ShuttingDown(Exception):
    """The grace period ran out while this request was in flight."""


class Drain:
    """The shutdown state of one app; see the module docstring."""

    def __init__(self) -> None:
        self.draining = False  # new requests are refused
        self.stopping = asyncio.Event()  # requests still in flight end now
        self.in_flight = 0  # HTTP requests whose response is not complete
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def stop_now(self) -> None:
        """End what is in flight without waiting for the rest of the grace period (a second signal)."""
        self.draining = True
        self.stopping.set()

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests, wait up to `grace_s` for those in flight, then end them; True: none had to be
        ended (all finished within the grace period)."""
        self.draining = True
        idle = asyncio.ensure_future(self._idle.wait())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({idle, stop}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        clean = idle.done() and not self.stopping.is_set()
        # Set either way: what is left ends now. After a clean drain that is only the connections that
        # outlive their requests (a Realtime session between responses closes with 1001, realtime/websocket.py).
        self.stopping.set()
        if not clean:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(idle, END_TIMEOUT_S)
        idle.cancel()
        return clean


async def until_stopped(items: AsyncIterator[T], stopping: asyncio.Event) -> AsyncIterator[T]:
    """`items` as they come; raises ShuttingDown as soon as `stopping` is set. The item being awaited is
    cancelled then (which closes `items` the way a client that left does), and also when this generator
    is closed or cancelled itself: `items` is never left running in a task of its own."""
    stop = asyncio.ensure_future(stopping.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise ShuttingDown
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            # Shielded: this also runs inside a cancelled scope (sse-starlette's, when the client left),
            # and `items` must have finished before whoever owns it closes it.
            with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                await nxt
