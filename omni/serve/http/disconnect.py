"""A request's work raced against its client leaving and against the end of a shutdown's grace period."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from omni.serve.http.shutdown import shutting_down

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def race(request: Request, work: Awaitable[T], stopping: asyncio.Event | None = None) -> T:
    """Await `work`, cancelled if the client disconnects first (ClientGone) or `stopping` is set first
    (503 `shutting_down`: the shutdown's grace period ran out)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watchers = {asyncio.ensure_future(disconnected())}
    if stopping is not None:
        watchers.add(asyncio.ensure_future(stopping.wait()))
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this handler was cancelled (a proxy that saw the client go)
        task.cancel()
        raise
    finally:
        for w in watchers:
            w.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if stopping is not None and stopping.is_set():
            raise shutting_down("its grace period ran out before this reply was complete")
        raise ClientGone
    return task.result()
