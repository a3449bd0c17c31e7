"""Encoded videos (mp4, webm, mkv, ... as bytes) read with PyAV: what the container says, the frames a model samples,
the audio track.

    probe_video         the first video stream's frame count, frame rate, size and duration, whether there is an
                        audio track; every limit (VideoLimits) checked from these before a frame is decoded
    decode_frames       the frames at the given indices (in presentation order, as rgb24 [T, H, W, 3] uint8);
                        the others are decoded and dropped, never converted
    decode_audio_track  the first audio stream, resampled to mono float32 at the encoder's rate (FFmpeg's
                        resampler through PyAV)

Errors are RequestErrors naming the field (`multi_modal_data.video[0]`) and the numbers.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from omni.errors import RequestError


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """What a video may hold (stage model_kwargs `video_limits` overrides them)."""

    max_bytes: int = 256 << 20  # the encoded file
    max_seconds: float = 600.0  # its duration
    max_frames: int = 36_000  # frames in the file (each is decoded, sampled or not)
    max_pixels: int = 4096 * 2160  # per frame, before resizing

    @classmethod
    def of(cls, overrides: dict | None) -> VideoLimits:
        if not overrides:
            return cls()
        unknown = sorted(set(overrides) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"model_kwargs.video_limits: unknown key {unknown[0]!r} (allowed: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        return cls(**overrides)


@dataclass(frozen=True, slots=True)
class VideoInfo:
    frames: int
    fps: float
    height: int
    width: int
    seconds: float
    has_audio: bool


def _open(data: bytes, where: str):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError) as e:
        raise RequestError(f"{where}: not a readable video file: {e}", field=where) from None


def _fail(where: str, what: str, e: Exception) -> RequestError:
    return RequestError(f"{where}: the video could not be decoded ({what}): {e}", field=where)


def probe_video(data: bytes, where: str, limits: VideoLimits) -> VideoInfo:
    """The container's facts about its first video stream, checked against `limits`."""
    import av

    if len(data) > limits.max_bytes:
        raise RequestError(f"{where}: {len(data)} bytes of video, more than the limit of {limits.max_bytes}",
                           field=where, limit=limits.max_bytes, actual=len(data))
    with _open(data, where) as c:
        if not c.streams.video:
            raise RequestError(f"{where}: the file holds no video stream", field=where)
        s = c.streams.video[0]
        rate = s.average_rate or s.guessed_rate
        height, width = int(s.codec_context.height), int(s.codec_context.width)
        if height < 1 or width < 1:
            raise RequestError(f"{where}: the video stream has no frame size ({width}x{height})", field=where)
        if width * height > limits.max_pixels:
            raise RequestError(f"{where}: {width}x{height} frames ({width * height} pixels), more than the limit of "
                               f"{limits.max_pixels} pixels per frame", field=where, limit=limits.max_pixels,
                               actual=width * height)
        frames = int(s.frames or 0)
        if frames <= 0:  # no count in the header: count the packets (no decoding)
            try:
                frames = sum(1 for p in c.demux(s) if p.size)
            except av.FFmpegError as e:
                raise _fail(where, "reading its packets", e) from None
        if frames < 1:
            raise RequestError(f"{where}: the video stream holds no frames", field=where)
        if frames > limits.max_frames:
            raise RequestError(f"{where}: {frames} frames, more than the limit of {limits.max_frames}",
                               field=where, limit=limits.max_frames, actual=frames)
        if not rate or float(rate) <= 0:
            raise RequestError(f"{where}: the video stream has no frame rate", field=where)
        fps = float(rate)
        seconds = frames / fps
        if seconds > limits.max_seconds:
            raise RequestError(f"{where}: {seconds:.6g} s of video ({frames} frames at {fps:.6g} fps), longer than "
                               f"the limit of {limits.max_seconds:g} s", field=where, limit=limits.max_seconds,
                               actual=seconds)
        return VideoInfo(frames, fps, height, width, seconds, bool(c.streams.audio))


def decode_frames(data: bytes, indices: list[int], where: str) -> np.ndarray:
    """The frames at `indices` (sorted, repeats allowed) as [len(indices), H, W, 3] uint8 RGB."""
    import av

    wanted = set(indices)
    kept: dict[int, np.ndarray] = {}
    with _open(data, where) as c:
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        try:
            for k, frame in enumerate(c.decode(s)):
                if k in wanted:
                    kept[k] = frame.to_ndarray(format="rgb24")
                    if len(kept) == len(wanted):
                        break
        except av.FFmpegError as e:
            raise _fail(where, f"frame {len(kept)}", e) from None
    missing = sorted(k for k in wanted if k not in kept)
    if missing:
        raise RequestError(f"{where}: frame {missing[0]} could not be decoded (the stream ends after "
                           f"{max(kept, default=-1) + 1} frames)", field=where)
    shapes = {kept[k].shape for k in wanted}
    if len(shapes) != 1:
        raise RequestError(f"{where}: the video's frames change size ({sorted(shapes)})", field=where)
    return np.stack([kept[k] for k in indices])


def decode_audio_track(data: bytes, rate: int, where: str, limits: VideoLimits) -> np.ndarray | None:
    """The first audio stream as mono float32 at `rate` Hz, or None when the file has none."""
    import av

    with _open(data, where) as c:
        if not c.streams.audio:
            return None
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts: list[np.ndarray] = []
        total, cap = 0, int(limits.max_seconds * rate) + rate  # a track may run a little past the video
        try:
            for frame in c.decode(c.streams.audio[0]):
                for r in resampler.resample(frame):
                    parts.append(r.to_ndarray().reshape(-1))
                    total += parts[-1].shape[0]
                if total > cap:
                    raise RequestError(f"{where}: the audio track runs past {cap / rate:g} s, longer than the limit "
                                       f"of {limits.max_seconds:g} s", field=where, limit=limits.max_seconds,
                                       actual=total / rate)
            parts += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
        except av.FFmpegError as e:
            raise _fail(where, "its audio track", e) from None
    if not parts:
        return np.zeros(0, np.float32)
    return np.concatenate(parts).astype(np.float32, copy=False)
