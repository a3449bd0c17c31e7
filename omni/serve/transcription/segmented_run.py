"""A clip transcribed segment by segment: each speech segment (transcription/speech_segments.py) is a speech-recognition
request of its own (asr.asr_job), at most PARALLEL of them in the pipeline at once, so that the text stage batches
them; the segments come out in the clip's order.

    runs = SegmentedRun(state.omni, jobs, spans, default_rate)
    await runs.start()                 # the first segment submitted and alive, or its ApiError
    async for seg in runs.segments():  # TranscriptSegment, in order, each once its request finished
        ...
    await runs.aclose()                # every segment's request left (aborted where it still runs)

One failing segment fails the transcription: the others are left. Usage adds up over the segments (each one's
prompt was its own audio). The Run-like face (`t0`, the usage fields, `finish_reason`) is what the endpoints'
admission and metrics read.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from omni.async_api import AsyncOmni
from omni.serve.generation.job import Job
from omni.serve.generation.run import Run, TextEvent, leave_runs, summed
from omni.serve.generation.transcript import Transcript
from omni.serve.transcription.formats import TranscriptSegment
from omni.serve.transcription.speech_segments import SpeechSegment

PARALLEL = 4  # segments in the pipeline at once: enough for the text stage to batch, few enough to leave room


class SegmentedRun:
    def __init__(self, omni: AsyncOmni, jobs: list[Job], spans: list[SpeechSegment], default_rate: int,
                 marker: str | None = None):
        self.runs = [Run(omni, job, default_rate) for job in jobs]
        self.spans = spans
        self.marker = marker  # a speech recognizer's language tag ends with it (generation/transcript.py)
        self.t0 = time.monotonic()
        self._gate = asyncio.Semaphore(PARALLEL)
        self._tasks: list[asyncio.Task] = []

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.runs)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.runs)

    @property
    def cached_tokens(self) -> int | None:
        known = [r.cached_tokens for r in self.runs if r.cached_tokens is not None]
        return sum(known) if known else None

    @property
    def prompt_mm_tokens(self) -> dict[str, int]:
        return summed(r.prompt_mm_tokens for r in self.runs)

    @property
    def cached_mm_tokens(self) -> dict[str, int]:
        return summed(r.cached_mm_tokens for r in self.runs)

    @property
    def finish_reason(self) -> str | None:
        """"length" when any segment's reply hit its token bound, else the last segment's; None until known."""
        reasons = [r.finish_reason for r in self.runs]
        return "length" if "length" in reasons else (reasons[-1] if reasons else "stop")

    async def _transcribe(self, run: Run, span: SpeechSegment, admitted: asyncio.Event | None) -> TranscriptSegment:
        async with self._gate:
            await run.start()
            if admitted is not None:
                admitted.set()
            transcript = Transcript(self.marker)
            async for ev in run.events():
                if isinstance(ev, TextEvent):
                    transcript.feed(ev.text)
            transcript.finish()
        return TranscriptSegment(span, transcript.text, run.logprobs or [], transcript.language)

    async def start(self) -> None:
        """Start every segment (PARALLEL at a time); waits for the first one's admission so that a refused
        request is answered with its status before any reply is sent."""
        if not self.runs:
            return
        admitted = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._transcribe(r, s, admitted if i == 0 else None))
                       for i, (r, s) in enumerate(zip(self.runs, self.spans))]
        waiter = asyncio.ensure_future(admitted.wait())
        try:
            await asyncio.wait({self._tasks[0], waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        first = self._tasks[0]
        if first.done() and not first.cancelled() and first.exception() is not None:
            error = first.exception()
            await self.aclose()
            raise error

    async def segments(self) -> AsyncIterator[TranscriptSegment]:
        """Each segment's transcript in the clip's order; raises the first failure met (the rest left)."""
        try:
            for task in self._tasks:
                yield await task
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Leave every segment (aborted on every stage where it still runs)."""
        tasks, self._tasks = self._tasks, []
        await leave_runs(tasks, self.runs)
