"""The audio file formats of `/v1/audio/speech` (OpenAI's `response_format`).

    wav    16-bit PCM WAV (the standard library's `wave`, as the chat endpoint's audio)
    pcm    raw 16-bit little-endian mono samples at the pipeline's rate (24 kHz for Qwen2.5-Omni),
           no header; the only format streamed as the audio is made (the others need the whole waveform)
    flac   lossless (libsndfile via soundfile)
    mp3    MPEG layer III (libsndfile >= 1.1 via soundfile)
    opus   Opus in an Ogg container (libsndfile via soundfile; Opus takes 8/12/16/24/48 kHz)

`aac` has no encoder here: a request for it is a 400 naming `response_format`. What libsndfile can
encode is asked of the installed library once, so a build without MP3 refuses mp3 the same way.
"""
from __future__ import annotations

import functools
import io

import numpy as np

from omni.serve.audio.codecs import encode_wav, to_pcm16
from omni.serve.audio.resampling import resample

OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
# response_format -> (libsndfile container, subtype)
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@functools.cache
def encodable() -> tuple[str, ...]:
    """The response formats this server can write (wav and pcm always; the rest as libsndfile allows)."""
    import soundfile as sf

    formats, out = sf.available_formats(), ["wav", "pcm"]
    for name, (container, subtype) in _SOUNDFILE.items():
        if container in formats and subtype in sf.available_subtypes(container):
            out.append(name)
    return tuple(out)


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """A mono float32 waveform as a file of format `fmt` (one of `encodable()`)."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    if fmt == "pcm":
        return to_pcm16(x)
    if fmt == "wav":
        return encode_wav(x, rate)
    import soundfile as sf

    container, subtype = _SOUNDFILE[fmt]
    if fmt == "opus" and rate not in _OPUS_RATES:  # Opus runs at fixed rates: the nearest above
        target = next((r for r in _OPUS_RATES if r >= rate), 48000)
        x, rate = resample(x, rate, target), target
    # FLAC stores 16-bit samples: hand it the pcm16 the other formats carry (libsndfile's own float
    # conversion scales by 32768, ours by 32767), so a FLAC decodes to exactly the WAV's samples.
    data = np.frombuffer(to_pcm16(x), "<i2") if fmt == "flac" else np.clip(x, -1.0, 1.0)
    buf = io.BytesIO()
    sf.write(buf, data, rate, format=container, subtype=subtype)
    return buf.getvalue()
