"""Helpers of the `/v1/realtime` tests: reading server events with the real `openai` client, and real
recorded speech (not the model's own) from an installed package's sample clip."""
from __future__ import annotations

import asyncio
import importlib.util
import wave
from pathlib import Path
from typing import Any

import numpy as np

from omni.serve.audio.resampling import resample

EVENT_TIMEOUT_S = 120


async def until(conn: Any, kind: str, seen: list[Any] | None = None, timeout_s: float = EVENT_TIMEOUT_S) -> Any:
    """Server events up to and including the first of type `kind` (appended to `seen`); returns that one."""
    async def read() -> Any:
        while True:
            ev = await conn.recv()
            if seen is not None:
                seen.append(ev)
            if ev.type == kind:
                return ev

    return await asyncio.wait_for(read(), timeout_s)


def types(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def speech_wav() -> Path:
    """Moonshine's sample clip (a person reading, 16 kHz mono, ~10 s; the package is MIT licensed), found
    through the import system without importing the package (onnxruntime is not installed)."""
    spec = importlib.util.find_spec("moonshine_onnx")
    assert spec is not None and spec.submodule_search_locations, "useful-moonshine-onnx is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "beckett.wav"
    assert path.is_file(), path
    return path


def speech_24k(seconds: float | None = None, offset_s: float = 0.0) -> np.ndarray:
    """The clip as float32 at 24 kHz (the Realtime protocol's rate), optionally a part of it."""
    with wave.open(str(speech_wav())) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767.0
    start = int(offset_s * rate)
    end = x.size if seconds is None else start + int(seconds * rate)
    return resample(x[start:end], rate, 24000)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def ran_to_its_end(response) -> bool:
    """A response that was neither cancelled nor failed: completed, or stopped by its token bound (OpenAI's
    "incomplete" with reason max_output_tokens: the tiny random models rarely end a reply by themselves)."""
    return response.status == "completed" or (response.status == "incomplete"
                                               and response.status_details.reason == "max_output_tokens")


async def connect(server: Any, model: str, session: dict[str, Any]) -> Any:
    """A realtime connection to `server`, its session updated to `session` (both acknowledged)."""
    conn = await server.async_client().realtime.connect(model=model).enter()
    await until(conn, "session.created")
    await conn.session.update(session=session)
    await until(conn, "session.updated")
    return conn
