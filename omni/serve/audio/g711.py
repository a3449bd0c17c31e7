"""G.711 telephony audio for `/v1/realtime` (`audio/pcmu`: mu-law, `audio/pcma`: A-law; 8 kHz, one byte a
sample), as OpenAI's Realtime API takes and gives it (a phone line's Twilio media stream, for one).

    codec      ITU-T G.711 on 16-bit linear samples, bit for bit what Python's audioop (lin2ulaw / ulaw2lin,
               lin2alaw / alaw2lin) computes (tested against it over every input)

Its 8 kHz <-> 24 kHz resampling (the session runs at 24 kHz) is audio/resampling.py's Resampler8k24k.
"""
from __future__ import annotations

import numpy as np

G711_RATE = 8000
FORMATS = ("audio/pcmu", "audio/pcma")

_BIAS = 0x84
_U_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])  # 14-bit magnitudes


def _to_int16(x: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> int16 as the pcm16 path makes it (omni/serve/audio/codecs.py to_pcm16: clip, x 32767)."""
    return (np.clip(np.asarray(x, np.float32).reshape(-1), -1.0, 1.0) * 32767.0).astype(np.int16)


def ulaw_encode(x: np.ndarray) -> bytes:
    """float waveform -> mu-law bytes (G.711 on the 14-bit sample, as audioop.lin2ulaw)."""
    s = _to_int16(x).astype(np.int32) >> 2
    mask = np.where(s < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(s), 8159) + (_BIAS >> 2)
    seg = np.searchsorted(_U_SEG_END, mag)  # the first segment whose end >= mag
    code = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (seg + 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8).tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> float waveform (x / 32767, as pcm16_to_float)."""
    u = ~np.frombuffer(data, np.uint8).astype(np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + _BIAS) << ((u & 0x70) >> 4)
    lin = np.where(u & 0x80, _BIAS - t, t - _BIAS)
    return (lin.astype(np.float32) / 32767.0).astype(np.float32)


_A_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def alaw_encode(x: np.ndarray) -> bytes:
    """float waveform -> A-law bytes."""
    s = _to_int16(x).astype(np.int32) >> 3  # A-law codes 13-bit magnitudes
    mask = np.where(s >= 0, 0xD5, 0x55)
    mag = np.where(s >= 0, s, -s - 1)
    seg = np.searchsorted(_A_SEG_END, mag)
    aval = np.where(seg < 2, (seg << 4) | ((mag >> 1) & 0x0F), (seg << 4) | ((mag >> np.maximum(seg, 1)) & 0x0F))
    code = np.where(seg >= 8, 0x7F, aval)
    return (code ^ mask).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> float waveform."""
    a = np.frombuffer(data, np.uint8).astype(np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << np.maximum(seg - 1, 0)))
    lin = np.where(a & 0x80, t, -t)
    return (lin.astype(np.float32) / 32767.0).astype(np.float32)


def encode(fmt: str, x: np.ndarray) -> bytes:
    return ulaw_encode(x) if fmt == "audio/pcmu" else alaw_encode(x)


def decode(fmt: str, data: bytes) -> np.ndarray:
    return ulaw_decode(data) if fmt == "audio/pcmu" else alaw_decode(data)
