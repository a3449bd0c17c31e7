"""AsyncOmni: Omni for asyncio code (the OpenAI server builds on it).

    async with AsyncOmni("stage_configs/tiny_chain.yaml") as o:
        out = await o.generate("Hello", SamplingParams(temperature=0, max_tokens=8))
        async for item in o.stream("Tell me a story"):     # StageDelta ..., then StageOutput(s)
            ...

One driver thread per AsyncOmni moves the pipeline (the Orchestrator's `step`, which
waits on the backend with a timeout) and hands each request's events to the event loop
that asked for them (`call_soon_threadsafe` into an asyncio.Queue): the caller's
coroutines only await, nothing polls in them, and any number of requests run
concurrently. Cancelling a `generate` task, or closing / cancelling a `stream`,
aborts the request on every stage (their KV blocks are released).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni.api import Omni
from omni.config.checked import load_checked
from omni.config.schema import PipelineConfig
from omni.errors import BackendClosedError, RequestAbortedError, RequestError
from omni.messages import RequestOutput, StageDelta, StageInput, StageOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # the driver thread's sleep while no request is in flight


@dataclass(slots=True)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: StageDelta | StageOutput, then the RequestOutput (last)
    stream: bool


class AsyncOmni:
    """A multi-stage pipeline for asyncio: `generate`, `stream`, `abort`, `stats`, `close`."""

    def __init__(self, config_or_path: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig,
                 stage_overrides: str | Mapping[str, Any] | None = None, backend: str | None = None, *,
                 engine_factory: Any = None):
        """Starts the stages (blocking, like Omni); use `await AsyncOmni.create(...)` inside a running loop."""
        self._omni = Omni(config_or_path, stage_overrides, backend, engine_factory=engine_factory)
        self._orch = self._omni._orch
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._drive, name="omni-async-driver", daemon=True)
        self._thread.start()

    @staticmethod
    def load_config(config_or_path: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig,
                    stage_overrides: str | Mapping[str, Any] | None = None, *, memory_gb: float | None = None,
                    check_paths: bool = False) -> PipelineConfig:
        """The config AsyncOmni(config_or_path, stage_overrides) would run, validated (ConfigError otherwise),
        before anything starts: what a server refuses before it listens. `memory_gb` sets
        runtime.memory.budget_gb; `check_paths`: also check the model paths where the stages run."""
        return load_checked(config_or_path, stage_overrides, memory_gb, check_paths)[0]

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> "AsyncOmni":
        """Construct without blocking the event loop (stage start-up runs in a thread)."""
        return await asyncio.get_running_loop().run_in_executor(None, lambda: cls(*args, **kwargs))

    @property
    def config(self) -> PipelineConfig:
        return self._omni.config

    @property
    def stage_names(self) -> list[str]:
        return self._omni.stage_names

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ requests
    async def generate(self, prompt: Any, sampling_params: Any = None, *, request_id: str | None = None,
                       return_hidden_states: bool = False,
                       output_modalities: Sequence[str] | None = None) -> RequestOutput:
        """Run one prompt through the pipeline; its RequestOutput (`error` set when it failed).
        `output_modalities`: as Omni.generate's (only the stages the wanted outputs need run)."""
        rid, waiter = self._add(prompt, sampling_params, request_id, return_hidden_states, stream=False,
                                output_modalities=output_modalities)
        try:
            while True:
                item = await waiter.queue.get()
                if isinstance(item, RequestOutput):
                    return item
        finally:
            self._forget(rid)

    async def stream(self, prompt: Any, sampling_params: Any = None, *, request_id: str | None = None,
                     return_hidden_states: bool = False,
                     output_modalities: Sequence[str] | None = None) -> AsyncIterator[StageDelta | StageOutput]:
        """Yield one prompt's StageDeltas as they happen, then each final stage's StageOutput (a failed
        request yields one StageOutput with `error` set). Leaving early aborts the request.
        `output_modalities`: as Omni.generate's."""
        rid, waiter = self._add(prompt, sampling_params, request_id, return_hidden_states, stream=True,
                                output_modalities=output_modalities)
        try:
            while True:
                item = await waiter.queue.get()
                if isinstance(item, RequestOutput):
                    return
                yield item
        finally:
            self._forget(rid)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request on every stage; False if it is not running."""
        return self._orch.abort(request_id)

    def complete(self, request_id: str) -> bool:
        """The caller has all it asked for of a running request (a text-only reply whose text is whole): stop
        what still runs of it (the audio stages nobody listens to) on every stage. Unlike `abort`, it counts as
        finished in stats()' requests. False if it is not running."""
        with self._lock:
            if self._closed or request_id not in self._waiters:
                return False
            return self._orch.abort(request_id, complete=True)

    async def stats(self) -> dict[str, Any]:
        """Omni.stats(), off the event loop (on Ray it asks every stage actor)."""
        return await asyncio.get_running_loop().run_in_executor(None, self._omni.stats)

    async def tokenize(self, prompt: Any, **kw: Any) -> dict[str, Any]:
        """Omni.tokenize(), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._omni.tokenize, prompt,
                                                                                        **kw))

    async def detokenize(self, token_ids: list[int], **kw: Any) -> str:
        """Omni.detokenize(), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._omni.detokenize,
                                                                                        token_ids, **kw))

    def voices(self) -> tuple[str, ...]:
        """Omni.voices() (read when the stages started: no call to them)."""
        return self._omni.voices()

    def shows_tools(self) -> bool | None:
        """Omni.shows_tools() (as voices())."""
        return self._omni.shows_tools()

    def speaks_prompt(self) -> bool:
        """Omni.speaks_prompt() (as voices())."""
        return self._omni.speaks_prompt()

    def clones_voices(self) -> bool:
        """Omni.clones_voices() (as voices())."""
        return self._omni.clones_voices()

    def transcribes_audio(self) -> bool:
        """Omni.transcribes_audio() (as voices())."""
        return self._omni.transcribes_audio()

    def transcript_marker(self) -> str | None:
        """Omni.transcript_marker() (as voices())."""
        return self._omni.transcript_marker()

    def input_media(self) -> tuple[str, ...] | None:
        """Omni.input_media() (as voices())."""
        return self._omni.input_media()

    def context_reserve(self) -> int:
        """Omni.context_reserve() (as voices())."""
        return self._omni.context_reserve()

    def min_spoken_tokens(self) -> int:
        """Omni.min_spoken_tokens() (as voices())."""
        return self._omni.min_spoken_tokens()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self) -> None:
        """Stop the driver thread and the stages (blocking; idempotent). Requests in flight fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiters = dict(self._waiters)
        self._work.set()
        self._thread.join(timeout=30)
        for rid, w in waiters.items():
            self._orch.abort(rid)
            out = self._orch.pop_result(rid) or RequestOutput(rid, error=RequestAbortedError(
                "the pipeline was closed", request_id=rid, code="shutting_down"))
            self._deliver(w, [], out)
        self._omni.close()

    async def __aenter__(self) -> "AsyncOmni":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------- helpers
    def _add(self, prompt: Any, sampling_params: Any, request_id: str | None, hidden: bool,
             stream: bool, output_modalities: Sequence[str] | None = None) -> tuple[str, _Waiter]:
        if self._closed:
            raise BackendClosedError("this AsyncOmni pipeline is closed")
        if isinstance(prompt, (list, tuple)):
            raise RequestError("prompt: AsyncOmni takes one prompt per call (a str, a dict or a StageInput); "
                               "run several calls concurrently for a batch", field="prompt")
        inp = self._omni._to_input(0, prompt)
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise RequestError(f"request_id: expected a non-empty str, got {request_id!r}", field="request_id")
            inp = dataclasses.replace(inp, request_id=request_id)
        sampling = self._omni._per_stage_sampling(sampling_params)
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue(), stream)
        with self._lock:
            rid = self._orch.add_request(inp, sampling, return_hidden_states=hidden, stream=stream,
                                         output_modalities=output_modalities)
            self._waiters[rid] = waiter
        self._work.set()
        return rid, waiter

    def _forget(self, rid: str) -> None:
        """The caller is done with `rid`: abort it if it still runs (cancelled or left early)."""
        with self._lock:
            waiter = self._waiters.pop(rid, None)
        if waiter is not None and not self._closed:
            if self._orch.abort(rid):
                logger.info("request %s aborted: its caller went away", rid)
            self._orch.pop_result(rid)

    def _drive(self) -> None:
        while not self._closed:
            with self._lock:
                busy = bool(self._waiters)
            if not busy:
                self._work.wait(_IDLE_WAIT_S)
                self._work.clear()
                continue
            try:
                self._orch.step()
            except Exception:  # noqa: BLE001 - the driver must survive a backend hiccup
                logger.exception("pipeline step failed")
            with self._lock:
                waiters = list(self._waiters.items())
            for rid, w in waiters:
                done = self._orch.is_done(rid)  # read before the events: none can be missed
                events = self._orch.pop_events(rid) if w.stream else []
                if done:
                    events += self._orch.pop_events(rid) if w.stream else []
                    out = self._orch.pop_result(rid)
                    with self._lock:
                        self._waiters.pop(rid, None)
                    self._deliver(w, events, out)
                elif events:
                    self._deliver(w, events, None)

    @staticmethod
    def _deliver(w: _Waiter, events: list[StageDelta | StageOutput], out: RequestOutput | None) -> None:
        def put() -> None:
            for e in events:
                w.queue.put_nowait(e)
            if out is not None:
                w.queue.put_nowait(out)
        try:
            w.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass
