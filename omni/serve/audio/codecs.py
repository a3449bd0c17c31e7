"""Audio at the server's edge: decoding what users send, encoding what the pipeline makes.

    decode_audio(bytes, rate_out)  WAV / FLAC / OGG / MP3 (libsndfile via soundfile) -> mono float32 at rate_out
    to_pcm16(x) / pcm16_to_float   OpenAI's pcm16: 16-bit little-endian mono
    encode_wav(x, rate)            a 16-bit PCM WAV file (the standard library's `wave`)
    sample_chunks(x, n)            a waveform as pieces of n samples (the streamed audio chunks)
    pcm16_chunks(x, n)             the same pieces as pcm16 (the SSE audio chunks)

The float -> pcm16 conversion is the same everywhere (WAV body, pcm16 reply, each streamed chunk), so
the streamed chunks concatenate to exactly the samples of the non-streamed WAV.
"""
from __future__ import annotations

import io
import re
import wave
from collections.abc import Iterator

import numpy as np

from omni.serve.audio.resampling import resample, resampled_length
from omni.serve.http.errors import bad_request, too_large


def decode_audio(data: bytes, where: str, max_decoded_bytes: int, rate_out: int | None = None
                 ) -> tuple[np.ndarray, int]:
    """An audio file -> (mono float32 waveform, sampling rate), resampled to `rate_out` when given.

    Every size that follows from the header is checked before anything is allocated (413 past
    `max_decoded_bytes`, counted as float32): the decoded samples, and the resampled waveform, whose
    length the header's rate sets (a header claiming 1 Hz asks 16000 samples at 16 kHz per frame)."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - libsndfile's errors are RuntimeError/LibsndfileError/TypeError
        # libsndfile's own words, without the file object it names ("Error opening <_io.BytesIO ...>: ")
        reason = re.sub(r"^Error opening <[^>]*>: ", "", str(e)).strip() or type(e).__name__
        raise bad_request(f"{where}: not a readable audio file (WAV, FLAC, OGG or MP3): {reason}", where) from None
    if info.frames <= 0 or info.channels <= 0 or info.samplerate <= 0:
        raise bad_request(f"{where}: the audio holds no samples", where)
    decoded = int(info.frames) * int(info.channels) * 4
    if decoded > max_decoded_bytes:
        raise too_large(f"{where}: {info.frames} frames x {info.channels} channels decode to {decoded} bytes, "
                        f"more than the server's limit of {max_decoded_bytes} (--max-media-mb)", where)
    if rate_out is not None:
        n_out = resampled_length(int(info.frames), int(info.samplerate), rate_out)
        if n_out * 4 > max_decoded_bytes:
            raise too_large(f"{where}: {info.frames} frames at {info.samplerate} Hz resample to {n_out} samples "
                            f"at {rate_out} Hz ({n_out * 4} bytes, {info.frames / info.samplerate:.6g} s), more "
                            f"than the server's limit of {max_decoded_bytes} (--max-media-mb)", where)
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        raise bad_request(f"{where}: the audio could not be decoded: {e}", where) from None
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if mono.size == 0:
        raise bad_request(f"{where}: the audio holds no samples", where)
    if not np.isfinite(mono).all():
        raise bad_request(f"{where}: the audio holds NaN or infinite samples", where)
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    if rate_out is None:
        return mono, int(rate)
    if resampled_length(mono.size, int(rate), rate_out) * 4 > max_decoded_bytes:  # the header under-told
        raise too_large(f"{where}: {mono.size} samples at {rate} Hz resample past the server's limit of "
                        f"{max_decoded_bytes} bytes (--max-media-mb)", where)
    return resample(mono, int(rate), rate_out), rate_out


# The longest clip the omni thinkers' audio encoders take (one Whisper window: 30 s); the server cuts longer
# audio it owns into clips (a realtime turn: realtime/conversation.py; a transcription: transcription/serving.py).
MODEL_CLIP_S = 30.0


def clips(wave: np.ndarray, rate: int, max_s: float = MODEL_CLIP_S) -> list[np.ndarray]:
    """The waveform cut into the fewest equal clips of at most `max_s` seconds (views, in order): equal, so that
    no clip is a sliver shorter than the encoder's first window."""
    limit = int(max_s * rate)
    if wave.shape[0] <= limit:
        return [wave]
    n = -(-wave.shape[0] // limit)
    size = -(-wave.shape[0] // n)
    return [wave[i:i + size] for i in range(0, wave.shape[0], size)]


def to_pcm16(x: np.ndarray) -> bytes:
    """float waveform in [-1, 1] -> 16-bit little-endian PCM bytes (clipped)."""
    x = np.clip(np.asarray(x, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (x * 32767.0).astype("<i2").tobytes()


def pcm16_to_float(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


def encode_wav(x: np.ndarray, rate: int) -> bytes:
    """A mono 16-bit PCM WAV file of the waveform."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(to_pcm16(x))
    return buf.getvalue()


def sample_chunks(x: np.ndarray, samples_per_chunk: int) -> Iterator[np.ndarray]:
    """The waveform (mono float32) as pieces of `samples_per_chunk` samples (the last may be shorter)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    step = max(1, int(samples_per_chunk))
    for i in range(0, x.size, step):
        yield x[i : i + step]


def pcm16_chunks(x: np.ndarray, samples_per_chunk: int) -> Iterator[bytes]:
    """The waveform as pcm16 pieces of `samples_per_chunk` samples (the last may be shorter)."""
    for piece in sample_chunks(x, samples_per_chunk):
        yield to_pcm16(piece)
