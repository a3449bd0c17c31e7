"""Workloads shared by the `omni bench` benchmarks (seeded, reproducible), and the two loops every
pipeline benchmark runs the same way:

    random_ids()       token ids for prompts whose content does not matter (pipeline, routing)
    Conversation       a multi-turn conversation as a chat client holds it: every turn resends the
                       conversation so far; `turns()` is the one conversation driver (pipeline, routing,
                       serve, omni, streaming's omni part)
    stream_timed()     streams prompts through Omni and times what the client sees per request: each
                       stage's first token, the first audio, each final output (routing, streaming, omni)
    closed_loop_timed()  the same through AsyncOmni with N clients, each sending its next prompt when its
                       last request ends (capacity)
    open_loop_timed()  the same with each prompt sent at its own time (poisson_arrivals()), whatever is
                       still running (capacity --rates)
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from typing import Any

NAMES = ["John Doe", "Jane Smith", "Alice Johnson", "Bob Brown", "Carol White", "Dave Green",
         "Emma Black", "Frank Blue", "Grace Yellow", "Henry Violet", "Irene Orange", "Jack Indigo",
         "Karen Red", "Leo Brown", "Mia Green", "Noah Yellow", "Olivia Blue", "Peter Black"]
JOBS = ["Engineer", "Doctor", "Teacher", "Artist", "Scientist", "Lawyer", "Musician", "Chef"]
COUNTRIES = ["USA", "Canada", "UK", "Australia", "New Zealand", "Ireland"]


def long_document(tokenizer, target_tokens: int = 2000, seed: int = 0) -> str:
    """A markdown table of people (as in the long-document QA example), ~target_tokens long."""
    rng = random.Random(seed)
    head = ("You are a helpful assistant that reads tables in markdown format. Here is a table.\n"
            "| ID | Name | Age | Occupation | Country | Email | Phone |\n|---|---|---|---|---|---|---|\n")
    rows, i = [], 1
    while True:
        name = rng.choice(NAMES)
        rows.append(f"| {i} | {name} | {rng.randint(20, 60)} | {rng.choice(JOBS)} | {rng.choice(COUNTRIES)} | "
                    f"{name.split()[0].lower()}.{i}@example.com | 555-{rng.randint(1000, 9999)} |\n")
        i += 1
        if i % 10 == 0 and len(tokenizer(head + "".join(rows))["input_ids"]) >= target_tokens:
            return head + "".join(rows)


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"\nQuestion: what is the age of {rng.choice(NAMES)}? Answer: The age is" for _ in range(n)]


@dataclass
class ThroughputRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def throughput_requests(num: int, vocab_size: int, seed: int = 0, min_prompt: int = 32,
                        max_prompt: int = 512, min_out: int = 16, max_out: int = 128) -> list[ThroughputRequest]:
    rng = random.Random(seed)
    return [ThroughputRequest([rng.randrange(100, vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))],
                              rng.randint(min_out, max_out)) for _ in range(num)]


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0


def random_ids(rng: random.Random, n: int) -> list[int]:
    """`n` token ids every real vocabulary has; the tokens themselves do not matter for timing."""
    return [rng.randrange(100, 1000) for _ in range(n)]


class Conversation:
    """A multi-turn conversation, as a chat client resends it every turn.

    Token ids (`Conversation(ids=...)`): each turn's prompt is the previous prompt + the reply's token ids
    + the next question's ids. Chat messages (`Conversation(messages=...)`): the user's turns and the
    assistant's replies as {"role", "content"} entries."""

    def __init__(self, *, ids: list[int] | None = None, messages: list[dict[str, Any]] | None = None):
        if (ids is None) == (messages is None):
            raise ValueError("Conversation: give either ids or messages")
        self.ids = None if ids is None else list(ids)
        self.messages = None if messages is None else list(messages)

    @property
    def prompt(self) -> Any:
        """What the next turn sends: the conversation so far (a copy)."""
        return list(self.ids) if self.ids is not None else list(self.messages)

    def ask(self, question: Any) -> Any:
        """The user's next turn (token ids, or message content); returns the prompt to send."""
        if self.ids is not None:
            self.ids += list(question)
        else:
            self.messages.append({"role": "user", "content": question})
        return self.prompt

    def answer(self, reply: Any) -> None:
        """The reply to the last turn (its token ids, or its text)."""
        if self.ids is not None:
            self.ids += list(reply)
        else:
            self.messages.append({"role": "assistant", "content": reply})

    def turns(self, questions: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """The conversation, turn by turn: asks each question (drawn only when its turn comes) and yields
        (turn index from 0, the prompt to send); the caller sends it, then answer()s the reply before the
        next turn. A first question of no ids ([]) sends the conversation as it stands (a first turn that
        is the context alone). Sync and async callers drive it alike; `break` ends the conversation."""
        for i, question in enumerate(questions):
            yield i, self.ask(question)


def with_media(mm: dict[str, Any], text: str) -> Any:
    """A user turn's message content: a placeholder part per medium in `mm` (multi_modal_data), then the
    text; the text alone when the turn carries no media."""
    return [{"type": kind} for kind in mm] + [{"type": "text", "text": text}] if mm else text


@dataclass(slots=True)
class TimedRequest:
    """One streamed request as its client saw it; times in seconds from the submission."""

    request_id: str
    first_token_s: dict[str, float] = field(default_factory=dict)  # stage -> its first delta with tokens
    first_audio_s: float | None = None  # the first delta carrying audio samples
    audio_deltas: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio) each
    output_s: dict[str, float] = field(default_factory=dict)  # final stage -> its output
    outputs: dict[str, Any] = field(default_factory=dict)  # final stage -> its StageOutput
    error: str | None = None  # the first error (a failed request ends with one)
    error_stage: str | None = None

    def first_audio_at(self, audio_stage: str) -> float:
        """When the caller had audio first: the first streamed chunk, or the finished waveform of `audio_stage`."""
        return self.output_s[audio_stage] if self.first_audio_s is None else self.first_audio_s


def playback_stall_s(deltas: list[tuple[float, float]]) -> float:
    """Silence a listener hears after playback began: a client that plays each audio chunk as soon as it arrives
    and the one before it has finished (at real time), from the first chunk on. `deltas` are (arrival s, audio s)
    in arrival order; 0 when every chunk came before the audio queued ahead of it ran out."""
    stall, plays_until = 0.0, None
    for arrival, seconds in deltas:
        if plays_until is not None and arrival > plays_until:
            stall += arrival - plays_until
        plays_until = max(arrival, plays_until or arrival) + seconds
    return stall


def _id_order(request_id: str) -> tuple[int, Any]:
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def _record(r: TimedRequest, ev: Any, now: float) -> None:
    """One streamed event (a StageDelta or a final StageOutput) of `r`, `now` seconds after its submission."""
    from omni.messages import StageDelta

    if isinstance(ev, StageDelta):
        if ev.token_ids and ev.stage not in r.first_token_s:
            r.first_token_s[ev.stage] = now
        if ev.audio is not None and len(ev.audio):
            if r.first_audio_s is None:
                r.first_audio_s = now
            r.audio_deltas.append((now, len(ev.audio) / (ev.sampling_rate or 24000)))
        return
    if ev.error and r.error is None:
        r.error, r.error_stage = ev.error, ev.stage
    r.outputs[ev.stage] = ev
    r.output_s[ev.stage] = now


def stream_timed(omni: Any, prompts: list[Any], sampling: Any = None) -> list[TimedRequest]:
    """Submit `prompts` at once through `omni.stream` and time every request (in request id order)."""
    t0 = time.perf_counter()
    recs: dict[str, TimedRequest] = {}
    for ev in omni.stream(prompts, sampling):
        r = recs.get(ev.request_id)
        if r is None:
            r = recs[ev.request_id] = TimedRequest(ev.request_id)
        _record(r, ev, time.perf_counter() - t0)
    return [recs[k] for k in sorted(recs, key=_id_order)]


async def closed_loop_timed(omni: Any, prompts: list[Any], concurrency: int, sampling: Any = None,
                            id_prefix: str = "") -> tuple[list[TimedRequest], float]:
    """`concurrency` clients share `prompts` (in order) through an AsyncOmni: each streams one request and
    sends the next when it ends (a closed loop). Every request is timed from its own submission; returns
    them in prompt order and the wall time from the first submission to the last end."""
    pending = list(enumerate(prompts))[::-1]
    recs: list[TimedRequest | None] = [None] * len(prompts)

    async def client() -> None:
        while pending:
            i, prompt = pending.pop()
            r = recs[i] = TimedRequest(f"{id_prefix}{i}")
            t0 = time.perf_counter()
            async for ev in omni.stream(prompt, sampling, request_id=r.request_id):
                _record(r, ev, time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, len(prompts))))))
    return [r for r in recs if r is not None], time.perf_counter() - t0


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Submission times (seconds from the first) of `n` requests arriving as a Poisson process of
    `rate_per_s` requests a second: exponential gaps drawn from a seeded generator, the first at 0."""
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):  # NaN and infinity are not rates either
        raise ValueError(f"an arrival rate must be a finite number > 0 requests per second, got {rate_per_s}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s)
        times.append(t)
    return times


async def open_loop_timed(omni: Any, prompts: list[Any], arrivals_s: list[float], sampling: Any = None,
                          id_prefix: str = "") -> tuple[list[TimedRequest], float]:
    """Each prompt submitted through an AsyncOmni at its time in `arrivals_s` (seconds from the start),
    whatever is still running: an open loop, users arriving on their own (vLLM's `benchmark_serving
    --request-rate`), where a closed loop's clients wait for their last reply and so synchronize when replies
    are equal. Every request is streamed and timed from its own submission; returns them in prompt order and
    the wall time from the first submission to the last end."""
    if len(arrivals_s) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(arrivals_s)} arrival times")
    recs = [TimedRequest(f"{id_prefix}{i}") for i in range(len(prompts))]
    t0 = time.perf_counter()

    async def one(r: TimedRequest, prompt: Any, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        start = time.perf_counter()
        async for ev in omni.stream(prompt, sampling, request_id=r.request_id):
            _record(r, ev, time.perf_counter() - start)

    await asyncio.gather(*(one(r, p, at) for r, p, at in zip(recs, prompts, arrivals_s)))
    return recs, time.perf_counter() - t0
