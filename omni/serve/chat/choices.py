"""A request's `n` choices: one Run per choice, started together, their pieces merged as they come.

OpenAI's `n` asks for that many replies to one prompt. Each choice is its own request through the
pipeline (ids `<rid>-0`, `<rid>-1`, ...): the stages batch them, and the prompt's blocks are shared by the
prefix cache once one choice has prefilled them. A request with a `seed` gives choice i the seed + i on
every stage whose sampling the request seeded (vLLM's n samples differ too), so the reply is
reproducible and its choices are not copies of each other; greedy choices are equal, as in vLLM.

A completions request may hold a batch of prompts: one Job per prompt, n choices of each, choice
`prompt_index * n + i` (vLLM's order), all submitted at once, so that the stages batch them.

    choices = Choices(omni, job, n, ...)     # or Choices(omni, [job per prompt], n, ...)
    await choices.start()                    # every choice submitted and alive, or ApiError (none left running)
    async for index, ev in choices.events():  # TextEvent / AudioEvent of choice `index`, in arrival order
        ...

Usage adds up as OpenAI's does: each prompt once, the completion tokens of every choice; a prompt's cached
tokens are the fewest any of its choices had (what the prompt cost at least once). One failing choice fails
the request: the others are aborted on every stage. Leaving early (closing `events()`, a cancelled task)
aborts them all.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator


from omni.async_api import AsyncOmni
from omni.serve.generation.job import Job
from omni.serve.generation.run import AudioEvent, Observer, Run, TextEvent, leave_runs, summed

_SEED_SPAN = 2**63  # SamplingParams seeds are non-negative 63-bit ints: choice seeds wrap within them
_DONE = object()


def choice_job(job: Job, index: int, n: int) -> Job:
    """The Job of choice `index` of `n`: its own request id (the request's own when n == 1) and, on every stage
    whose sampling has a seed, that seed + index."""
    if n == 1:
        return job
    sampling = {stage: ({**params, "seed": (int(params["seed"]) + index) % _SEED_SPAN}
                        if params.get("seed") is not None else dict(params))
                for stage, params in job.sampling.items()}
    return dataclasses.replace(job, request_id=f"{job.request_id}-{index}", sampling=sampling)


class Choices:
    """See the module docstring; the Run-like face (`start`, `aclose`, the usage fields, `finish_reason`,
    `t0`, `job`) is what the endpoints' admission and metrics read."""

    def __init__(self, omni: AsyncOmni, job: Job | list[Job], n: int, default_rate: int,
                 observer: Observer | None = None):
        jobs = job if isinstance(job, list) else [job]
        self.job = jobs[0]  # what every prompt's job shares (the request's options)
        self.n = n
        self.runs = [Run(omni, choice_job(j, i, n), default_rate, observer) for j in jobs for i in range(n)]
        self.t0 = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    def _prompts(self) -> list[list[Run]]:
        """The runs of each prompt (its n choices), in order."""
        return [self.runs[k:k + self.n] for k in range(0, len(self.runs), self.n)]

    # -------------------------------------------------------------- usage
    @property
    def prompt_tokens(self) -> int:
        return sum(max(r.prompt_tokens for r in runs) for runs in self._prompts())

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.runs)

    @property
    def audio_tokens(self) -> int:
        return sum(r.audio_tokens for r in self.runs)

    @property
    def cached_tokens(self) -> int | None:
        """Each prompt's fewest (None until every prompt's is known)."""
        fewest = [_fewest_cached(runs) for runs in self._prompts()]
        return None if any(r is None for r in fewest) else sum(r.cached_tokens for r in fewest)

    @property
    def prompt_mm_tokens(self) -> dict[str, int]:
        return summed(runs[0].prompt_mm_tokens for runs in self._prompts())  # one prompt for its choices

    @property
    def cached_mm_tokens(self) -> dict[str, int]:
        """Those of each prompt's choice with the fewest cached tokens (as cached_tokens)."""
        return summed(r.cached_mm_tokens for r in map(_fewest_cached, self._prompts()) if r is not None)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (the request's own when n == 1); None until it is known."""
        return self.runs[0].finish_reason

    # ---------------------------------------------------------------- run
    async def start(self) -> None:
        """Start every choice; when one is refused, the others are left and its ApiError raised."""
        results = await asyncio.gather(*(r.start() for r in self.runs), return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.aclose()
            raise failed

    async def events(self) -> AsyncIterator[tuple[int, TextEvent | AudioEvent]]:
        """(choice index, piece) as the pieces come; raises the first choice's error (the rest aborted)."""
        if len(self.runs) == 1:  # no merging to do: the run's own generator, in this task
            async with contextlib.aclosing(self.runs[0].events()) as evs:
                async for ev in evs:
                    yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, run: Run) -> None:
            try:
                async with contextlib.aclosing(run.events()) as evs:
                    async for ev in evs:
                        queue.put_nowait((index, ev))
                queue.put_nowait((index, _DONE))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, e))

        self._tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(self.runs)]
        try:
            running = len(self._tasks)
            while running:
                index, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Leave every choice (aborted on every stage where it still runs)."""
        tasks, self._tasks = self._tasks, []
        await leave_runs(tasks, self.runs)


def _fewest_cached(runs: list[Run]) -> Run | None:
    known = [r for r in runs if r.cached_tokens is not None]
    return min(known, key=lambda r: r.cached_tokens) if known else None
