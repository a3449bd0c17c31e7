"""How chat completions and completions answer: parse, admit, run, reply (JSON or server-sent events).

    body -> pydantic request (400 naming the field) -> model check (404) -> admission (503 past
    runtime.max_pending_requests) -> Job (media decoded off the event loop; 400 / 413) ->
    Choices.start (every choice's Run; 400 when the pipeline refuses it, 504 on timeout) -> reply

A client that disconnects aborts its request on every stage: while it waits for a non-streamed reply
(a watcher on the connection cancels the run), or mid-stream (the SSE response is cancelled). When a
shutdown's grace period runs out (http/shutdown.py), a waiting request is answered 503 and a stream ends
with an error event and [DONE]; their runs are aborted the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from omni.serve.chat.choices import Choices
from omni.serve.http.disconnect import ClientGone, race
from omni.serve.http.errors import ApiError, internal
from omni.serve.http.shutdown import ShuttingDown, shutting_down, until_stopped
from omni.serve.http.sse import DONE, PING_S, sse_event
from omni.serve.protocol.chat import ChatCompletionRequest
from omni.serve.protocol.completions import CompletionRequest
from omni.serve.state import ServerState

logger = logging.getLogger(__name__)


async def serve_choices(state: ServerState, request: Request, req: ChatCompletionRequest | CompletionRequest,
                 run_for: Any, reply: Any, stream: Any) -> Response:
    """Admission (one slot per choice of every prompt), the run, the reply; `run_for() -> Choices` builds the run
    (off the loop), `reply(run) -> Response` collects a non-streamed one, `stream(run) -> async iterator of SSE
    events` streams."""
    prompts = len(req.prompts) if isinstance(req, CompletionRequest) else 1
    count = prompts * req.choices
    if prompts > 1:
        state.admit(count, f"{prompts} prompts x {req.choices} choices", "prompt")
    else:
        state.admit(count)
    run: Choices | None = None
    handed_over = False
    reason = "error"
    try:
        run = await asyncio.to_thread(run_for)
        stopping = state.drain.stopping
        if not req.stream:
            response = await race(request, reply(run), stopping)
            reason = run.finish_reason or "stop"
            return response
        await race(request, run.start(), stopping)
        handed_over = True  # the stream releases the admission when it ends
        return _Stream(state, run, stream(run))
    except ClientGone:
        reason = "abort"
        return Response(status_code=499)
    finally:
        if not handed_over:
            if run is not None:
                await run.aclose()
            state.release(run, reason, count)


class _Stream(EventSourceResponse):
    """The SSE reply of one run: a failure midway is an error event (the status line is long gone), then
    [DONE]; so is the end of a shutdown's grace period (`shutting_down`). However the response ends (done, a disconnect, a body that never started because the client
    was gone already), the run is left (aborted where it still runs) and the admission released, once."""

    def __init__(self, state: ServerState, run: Choices, events: AsyncIterator[dict[str, Any]]):
        self._omni_state, self._run, self._finished = state, run, False
        super().__init__(self._body(events), sep="\n", ping=PING_S)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close("abort")

    async def _close(self, reason: str) -> None:
        if not self._finished:
            self._finished = True
            await self._run.aclose()
            self._omni_state.release(self._run, reason, len(self._run.runs))

    async def _body(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        run, reason = self._run, "abort"
        try:
            async with contextlib.aclosing(events) as evs, \
                    contextlib.aclosing(until_stopped(evs, self._omni_state.drain.stopping)) as items:
                async for ev in items:
                    yield sse_event(ev)
            reason = run.finish_reason or "stop"
        except ShuttingDown:
            reason = "error"
            yield sse_event(shutting_down("its grace period ran out before this stream was complete").body())
        except ApiError as e:
            reason = "error"
            yield sse_event(e.body())
        except Exception as e:  # noqa: BLE001 - a bug must still end the stream properly
            logger.exception("request %s failed while streaming", run.job.request_id)
            reason = "error"
            yield sse_event(internal(f"the server failed while streaming: {type(e).__name__}").body())
        finally:
            await self._close(reason)
        yield DONE

