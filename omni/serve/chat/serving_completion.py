"""`POST /v1/completions`: text or token ids in, one prompt or a batch (a choice per prompt and n), text out,
JSON or server-sent events (chat/replies.py admits, runs and answers)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.serve.chat import shapes as R
from omni.serve.chat.choices import Choices
from omni.serve.chat.jobs import completion_jobs
from omni.serve.chat.replies import serve_choices
from omni.serve.generation.run import TextEvent
from omni.serve.protocol.completions import CompletionRequest
from omni.serve.protocol.parse import parse_request
from omni.serve.state import ServerState, check_model


async def completions(state: ServerState, request: Request) -> Response:
    req = parse_request(CompletionRequest, await request.body())
    check_model(req.model, state.info)
    rid, created, model = R.new_id("cmpl", req.request_id), int(time.time()), state.info.model

    def run_for() -> Choices:
        return Choices(state.omni, completion_jobs(req, state.info, rid), req.choices,
                       state.settings.default_audio_rate, state.metrics)

    async def reply(run: Choices) -> Response:
        await run.start()
        async with contextlib.aclosing(run.events()) as evs:
            async for _ in evs:
                pass
        return JSONResponse(R.completion(rid, model, created, run))

    async def stream(run: Choices) -> AsyncIterator[dict[str, Any]]:
        offsets = [0] * len(run.runs)  # text_offset of each choice's next token, over its whole completion
        live = req.continuous_usage  # vLLM's continuous_usage_stats: every chunk with the usage so far

        def chunk(text: str | None, **kw: Any) -> dict[str, Any]:
            if live and "usage_" not in kw:
                kw["usage_"] = R.completion_usage(run)
            return R.completion_chunk(rid, model, created, text, **kw)

        async with contextlib.aclosing(run.events()) as evs:
            async for index, ev in evs:
                if isinstance(ev, TextEvent) and ev.echo:
                    logprobs = R.echo_logprobs(run.runs[index]) if run.runs[index].job.echo_logprobs else None
                    yield chunk(ev.text, index=index, logprobs=logprobs)
                    offsets[index] += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
                elif isinstance(ev, TextEvent) and (ev.text or ev.logprobs):
                    yield chunk(ev.text, index=index, logprobs=R.completion_logprobs(ev.logprobs, offsets[index]))
                    offsets[index] += sum(len(e.token or "") for e in ev.logprobs or ())
        for index, r in enumerate(run.runs):
            yield chunk("", finish_reason=r.finish_reason, index=index, stop_reason=r.stop_reason)
        if req.include_usage:
            yield chunk(None, usage_=R.completion_usage(run))

    return await serve_choices(state, request, req, run_for, reply, stream)
