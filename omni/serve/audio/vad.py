"""Server voice-activity detection for `/v1/realtime`: Silero VAD (a small recurrent network trained on
speech, the `silero-vad` package's TorchScript weights) and the turn logic around it.

    vad = TurnDetector(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    for ev in vad.feed(pcm_24k_float):      # any chunking; frames of 32 ms go through the model
        ev.kind in ("speech_started", "speech_stopped"), ev.ms (since the session's first audio)

Speech starts at the first frame whose speech probability reaches `threshold` (reported `prefix_padding_ms`
earlier, what the committed turn keeps before it); it stops once the probability stayed below
`threshold - 0.15` (Silero's own hysteresis) for `silence_duration_ms`, reported at the first quiet frame.

The weights are loaded from the installed package's data folder without importing `silero_vad` (whose
import sets torch's global thread count, which would change every stage in this process). Each session
has its own model instance (the network carries state from frame to frame), reused by a later session
(VadModels).
"""
from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni.serve.audio.resampling import resample

VAD_RATE = 16000
FRAME = 512  # samples at 16 kHz per model call (32 ms): the size Silero's 16 kHz model takes
FRAME_MS = FRAME * 1000 / VAD_RATE
HYSTERESIS = 0.15
_lock = threading.Lock()
_bytes: bytes | None = None


class VadUnavailable(RuntimeError):
    """The silero-vad package (its weights) is not installed."""


def weights_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadUnavailable("server VAD needs the silero-vad package (pip install --no-deps silero-vad)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    if not path.is_file():
        raise VadUnavailable(f"the silero-vad package has no {path.name} at {path.parent}")
    return path


def load_model() -> Any:
    """A fresh Silero VAD model (TorchScript; the file is read once per process)."""
    global _bytes
    import io

    import torch

    with _lock:
        if _bytes is None:
            _bytes = weights_path().read_bytes()
    model = torch.jit.load(io.BytesIO(_bytes), map_location="cpu")
    model.eval()
    return model


def speech_probabilities(samples: np.ndarray, rate: int, model: Any = None) -> np.ndarray:
    """A whole clip's speech probability per 32 ms frame (frame i covers i*FRAME_MS..(i+1)*FRAME_MS; a last
    partial frame is zero-padded), from a fresh model unless one is given (its state is reset first)."""
    import torch

    x = resample(np.asarray(samples, np.float32).reshape(-1), rate, VAD_RATE)
    frames = -(-x.size // FRAME)
    if frames == 0:
        return np.zeros(0, np.float32)
    x = np.concatenate([x, np.zeros(frames * FRAME - x.size, np.float32)])
    model = model if model is not None else load_model()
    model.reset_states()
    probs = np.empty(frames, np.float32)
    with torch.inference_mode():
        for i in range(frames):  # one call a frame: the network carries state from one frame to the next
            probs[i] = float(model(torch.from_numpy(x[i * FRAME:(i + 1) * FRAME]), VAD_RATE).item())
    return probs


class VadModels:
    """Silero models kept for reuse across a server's sessions: a session takes one (loaded only when none is
    free) and gives it back, its state reset, when it ends; at most `keep` are kept (--max-sessions: one a
    session). A session that connects after another ended starts its VAD at once."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return load_model()

    def give(self, model: Any) -> None:
        model.reset_states()
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(model)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass(slots=True)
class VadEvent:
    kind: str  # speech_started | speech_stopped
    ms: int


class TurnDetector:
    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500,
                 input_rate: int = 24000, model: Any = None):
        self.threshold = threshold
        self.prefix_padding_ms = prefix_padding_ms
        self.silence_duration_ms = silence_duration_ms
        self.input_rate = input_rate
        self.model = model if model is not None else load_model()
        self._frame_in = round(FRAME * input_rate / VAD_RATE)  # input samples per model frame
        self._pending = np.zeros(0, np.float32)
        self._frames = 0  # model frames seen
        self.speaking = False
        self._quiet_since: float | None = None
        self.last_prob = 0.0

    def configure(self, threshold: float | None, prefix_padding_ms: int | None,
                  silence_duration_ms: int | None) -> None:
        if threshold is not None:
            self.threshold = threshold
        if prefix_padding_ms is not None:
            self.prefix_padding_ms = prefix_padding_ms
        if silence_duration_ms is not None:
            self.silence_duration_ms = silence_duration_ms

    @property
    def ms(self) -> float:
        """Audio time consumed so far (ms)."""
        return self._frames * FRAME_MS

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        import torch

        self._pending = np.concatenate([self._pending, np.asarray(samples, np.float32).reshape(-1)])
        events: list[VadEvent] = []
        n = self._frame_in
        while self._pending.size >= n:
            frame, self._pending = self._pending[:n], self._pending[n:]
            if self.input_rate != VAD_RATE:
                frame = resample(frame, self.input_rate, VAD_RATE)
            with torch.inference_mode():
                prob = float(self.model(torch.from_numpy(np.ascontiguousarray(frame[:FRAME])), VAD_RATE).item())
            self.last_prob = prob
            start = self._frames * FRAME_MS
            self._frames += 1
            if not self.speaking:
                if prob >= self.threshold:
                    self.speaking, self._quiet_since = True, None
                    events.append(VadEvent("speech_started", int(max(0.0, start - self.prefix_padding_ms))))
                continue
            if prob >= self.threshold:
                self._quiet_since = None
            elif prob < self.threshold - HYSTERESIS and self._quiet_since is None:
                self._quiet_since = start
            if self._quiet_since is not None and self.ms - self._quiet_since >= self.silence_duration_ms:
                events.append(VadEvent("speech_stopped", int(self._quiet_since)))
                self.speaking, self._quiet_since = False, None
        return events

    def reset(self) -> None:
        """Forget the speech in progress (the buffer was cleared); the clock goes on."""
        self.speaking, self._quiet_since = False, None
        self.model.reset_states()
