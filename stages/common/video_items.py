"""A prompt's video input as an MMItem, for every omni family's thinker: its frames sampled and preprocessed as
transformers' Qwen2-VL video processor does (stages/common/video.py), and with `use_audio_in_video` its audio track
interleaved with its frames by time, as the family's processor lays them out.

    use_audio_in_video   the request's `mm_processor_kwargs` (vLLM's): the one key the omni thinkers take
    chunked_layout       Qwen2.5-Omni's processor: the video's and the track's tokens in chunks of
                         `seconds_per_chunk`, each chunk's video tokens first
    merged_layout        Qwen3-Omni's processor: tokens merged by time, a video token first at equal times
    video_item           the MMItem: checked (limits, the token count against the model's positions) before a frame
                         is decoded; hashed over the file (or frames), their rate and the track
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni.errors import ContextLengthError, RequestError
from omni.messages import MultiModalInput, StageInput

from stages.common.mm_items import MMItem, mm_hash
from stages.common.video import preprocess_video, sample_indices, video_grid
from stages.common.video_decode import VideoLimits, decode_audio_track, decode_frames, probe_video

MM_PROCESSOR_KEYS = ("use_audio_in_video",)


def use_audio_in_video(inp: StageInput) -> bool:
    """`mm_processor_kwargs.use_audio_in_video` (False when absent); other keys are refused, naming them."""
    kwargs = inp.mm_processor_kwargs or {}
    unknown = sorted(set(kwargs) - set(MM_PROCESSOR_KEYS))
    if unknown:
        raise RequestError(f"mm_processor_kwargs.{unknown[0]}: not a setting of this model's processor (it takes "
                           f"{', '.join(MM_PROCESSOR_KEYS)})", field=f"mm_processor_kwargs.{unknown[0]}")
    flag = kwargs.get("use_audio_in_video", False)
    if not isinstance(flag, bool):
        raise RequestError(f"mm_processor_kwargs.use_audio_in_video: expected true or false, got {flag!r}",
                           field="mm_processor_kwargs.use_audio_in_video")
    if flag and not any(m.modality == "video" for m in inp.mm_inputs):
        return False  # transformers' processors: without videos there is no audio track to use
    return flag


def video_token_times(grid: torch.Tensor, merge_size: int, second_per_grid: float, per_second: float) -> np.ndarray:
    """Each video token's time in rotary positions (the processors' `video_token_indices`)."""
    t, h, w = (int(v) for v in grid)
    frames = np.broadcast_to(np.arange(t).reshape(-1, 1, 1), (t, h // merge_size, w // merge_size)).reshape(-1)
    return frames * second_per_grid * per_second


def _chunks(times: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """Qwen2.5-Omni's processor `get_chunked_index`: slices of `times` by successive ranges of `per_chunk`."""
    out, start, chunk = [], 0, 1
    for i, value in enumerate(times):
        if value >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(times)))
    return out


def chunked_layout(video_times: np.ndarray, audio_tokens: int, per_second: float,
                   seconds_per_chunk: float) -> list[bool]:
    """Qwen2.5-Omni: True for a video token, False for an audio token, in the order the processor writes them."""
    per_chunk = int(per_second * seconds_per_chunk)
    video, audio = _chunks(video_times, per_chunk), _chunks(np.arange(audio_tokens), per_chunk)
    out: list[bool] = []
    for j in range(max(len(video), len(audio))):
        if j < len(video):
            out += [True] * (video[j][1] - video[j][0])
        if j < len(audio):
            out += [False] * (audio[j][1] - audio[j][0])
    return out


def merged_layout(video_times: np.ndarray, audio_tokens: int, per_second: float,
                  seconds_per_chunk: float) -> list[bool]:
    """Qwen3-Omni: video and audio tokens merged by time (audio token k at time k), video first at a tie."""
    out: list[bool] = []
    v = a = 0
    while v < len(video_times) and a < audio_tokens:
        if video_times[v] <= a:
            out.append(True)
            v += 1
        else:
            out.append(False)
            a += 1
    return out + [True] * (len(video_times) - v) + [False] * (audio_tokens - a)


@dataclass(frozen=True, slots=True)
class VideoSpec:
    """How one family's thinker takes videos."""

    cfg: dict[str, Any]  # stages/common/video.py video_settings
    limits: VideoLimits
    video_id: int  # the video pad token
    audio_id: int  # the audio pad token
    audio_bos: int
    audio_eos: int
    per_second: float  # config.position_id_per_seconds
    seconds_per_chunk: float
    layout: Callable[[np.ndarray, int, float, float], list[bool]]
    audio_rate: int = 16000


def _frames_of_array(arr: np.ndarray, where: str, limits: VideoLimits) -> np.ndarray:
    if not np.issubdtype(arr.dtype, np.integer) or (arr.size and (arr.min() < 0 or arr.max() > 255)):
        lo, hi = (arr.min(), arr.max()) if arr.size else (0, 0)
        raise RequestError(f"{where}: frames must be integers 0..255 (uint8), got {arr.dtype} in [{lo}, {hi}]",
                           field=where)
    t, h, w = arr.shape[:3]
    if t < 1 or h < 1 or w < 1:
        raise RequestError(f"{where}: the video is empty ({t} frames of {h}x{w})", field=where)
    if t > limits.max_frames:
        raise RequestError(f"{where}: {t} frames, more than the limit of {limits.max_frames}", field=where,
                           limit=limits.max_frames, actual=t)
    if h * w > limits.max_pixels:
        raise RequestError(f"{where}: {w}x{h} frames ({w * h} pixels), more than the limit of {limits.max_pixels} "
                           "pixels per frame", field=where, limit=limits.max_pixels, actual=w * h)
    return arr


def _rgb(frames: np.ndarray) -> np.ndarray:
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    return np.ascontiguousarray(frames[..., :3], dtype=np.uint8)


def video_item(inp: MultiModalInput, spec: VideoSpec, where: str, max_model_len: int, *, with_audio: bool,
               track: np.ndarray | None, audio_item: Callable[[MultiModalInput, str], MMItem]) -> MMItem:
    """One video input -> MMItem("video"). `with_audio`: interleave its audio track (`track`: the track as given,
    mono at the encoder's rate; None: decoded from the file); `audio_item` makes the track's audio MMItem."""
    data = np.asarray(inp.data)
    encoded = data.ndim == 1 and data.dtype == np.uint8
    if not encoded and (data.ndim != 4 or data.shape[-1] not in (1, 3, 4)):
        raise RequestError(f"{where}: expected a video file's bytes (1-D uint8) or frames (TxHxWxC with C in "
                           f"(1, 3, 4)), got a {data.dtype} array of shape {data.shape}", field=where)
    if encoded:
        blob = data.tobytes()
        info = probe_video(blob, where, spec.limits)
        total, fps, height, width = info.frames, info.fps, info.height, info.width
    else:
        _frames_of_array(data, where, spec.limits)
        total, fps, (height, width) = data.shape[0], inp.fps, data.shape[1:3]
        if fps is not None and total / fps > spec.limits.max_seconds:
            raise RequestError(f"{where}: {total / fps:.6g} s of video ({total} frames at {fps:.6g} fps), longer "
                               f"than the limit of {spec.limits.max_seconds:g} s", field=where,
                               limit=spec.limits.max_seconds, actual=total / fps)
    cfg = spec.cfg
    indices = sample_indices(total, fps, cfg, where)
    grid = torch.tensor(video_grid(len(indices), height, width, cfg), dtype=torch.long)
    video_tokens = int(grid.prod()) // cfg["merge_size"] ** 2
    if video_tokens > max_model_len:  # before a frame is decoded
        raise ContextLengthError(f"{where}: {len(indices)} sampled frames of {width}x{height} take {video_tokens} "
                                 f"placeholder tokens, more than the model's {max_model_len} positions",
                                 field=where, limit=max_model_len, actual=video_tokens)
    audio = None
    if with_audio:
        if track is None and encoded:
            track = decode_audio_track(blob, spec.audio_rate, where, spec.limits)
        if track is None or track.size == 0:
            raise RequestError(f"{where}: use_audio_in_video needs the video's audio track, and this video has none "
                               "(send it without use_audio_in_video, or its track under multi_modal_data.audio)",
                               field=where)
        audio = audio_item(MultiModalInput("audio", track, spec.audio_rate), f"{where}.audio")
    frames = decode_frames(blob, indices, where) if encoded else data[indices]
    pixels, made = preprocess_video(_rgb(frames), cfg, where)
    if not torch.equal(made, grid):
        raise AssertionError(f"{where}: video grid {made.tolist()} != {grid.tolist()} predicted from its size")
    second_per_grid = cfg["temporal_patch_size"] / cfg["fps"]
    item = MMItem("video", mm_hash(inp, audio.mm_hash if audio is not None else ""), video_tokens, pixels, grid,
                  second_per_grid=second_per_grid)
    if audio is not None:
        times = video_token_times(grid, cfg["merge_size"], second_per_grid, spec.per_second)
        layout = spec.layout(times, audio.num_tokens, spec.per_second, spec.seconds_per_chunk)
        item.audio, item.num_tokens, item.lead = audio, len(layout), 1
        item.ids = [spec.audio_bos] + [spec.video_id if v else spec.audio_id for v in layout] + [spec.audio_eos]
        if item.num_tokens > max_model_len:
            raise ContextLengthError(f"{where}: the video and its audio track take {item.num_tokens} placeholder "
                                     f"tokens, more than the model's {max_model_len} positions", field=where,
                                     limit=max_model_len, actual=item.num_tokens)
    return item


def video_tracks(inp: StageInput, with_audio: bool) -> tuple[list[MultiModalInput], list[np.ndarray | None]]:
    """With use_audio_in_video the prompt's audio inputs may be its videos' tracks (vLLM's way: one audio per
    video, in order, and no other audio); returns the inputs left as media items and each video's given track."""
    videos = [m for m in inp.mm_inputs if m.modality == "video"]
    audios = [m for m in inp.mm_inputs if m.modality == "audio"]
    if not with_audio or not audios:
        return list(inp.mm_inputs), [None] * len(videos)
    if len(audios) != len(videos):
        raise RequestError(f"multi_modal_data.audio: with use_audio_in_video, the audio inputs are the videos' "
                           f"tracks, one per video: got {len(audios)} for {len(videos)} videos",
                           field="multi_modal_data.audio")
    tracks = []
    for k, a in enumerate(audios):
        if a.sampling_rate is not None and a.sampling_rate != 16000:
            raise RequestError(f"multi_modal_data.audio[{k}]: sampling_rate must be 16000 Hz, got {a.sampling_rate} "
                               "(resample the track first)", field=f"multi_modal_data.audio[{k}]")
        tracks.append(np.asarray(a.data))
    return [m for m in inp.mm_inputs if m.modality != "audio"], tracks
