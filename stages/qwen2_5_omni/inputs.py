"""Qwen2.5-Omni prompt building and multimodal preprocessing (no model weights needed).

- `messages_for` + `render_chat`: chat messages (or text) -> the prompt text with one placeholder per
  image/audio; `expand_placeholders` then expands each placeholder token to the number of tokens its
  encoder produces (the thinker's `preprocess` tokenizes in between).
- Images: with Pillow installed (it is pinned), transformers' own Qwen2-VL image processor (its
  Pillow backend: the processor Qwen2_5OmniProcessor uses without torchvision), so pixel values equal
  the reference processor's bit for bit. Without Pillow (or a transformers that lacks that backend), a
  torch port of the same patchification (resize to multiples of 28 within min/max pixels, CLIP
  normalisation, temporal patch of 2, patches ordered by 2x2 merge groups) whose bicubic resize may
  differ from Pillow's by rounding.
- Audio: transformers' WhisperFeatureExtractor (128 mel bins, padded to 30 s, valid frames kept).
- Every input is content-hashed (xxhash of its bytes): the hash keys the encoder cache and the
  KV-block extra keys, so prompts that differ only in an image never share a block.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from omni.errors import RequestError
from omni.messages import MultiModalInput
from omni.prompts import check_messages

from stages.common.media import check_audio, check_image

IMAGE_TOKEN, AUDIO_TOKEN = "<|IMAGE|>", "<|AUDIO|>"
IMAGE_PLACEHOLDER = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
DEFAULT_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)
PREPROCESS_DEFAULTS = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 56 * 56, "max_pixels": 12845056,  # Qwen2.5-Omni-7B preprocessor_config
    "audio_sampling_rate": 16000, "num_mel_bins": 128, "system_prompt": DEFAULT_SYSTEM,
}


@dataclass(slots=True)
class MMItem:
    """One preprocessed multimodal input of a prompt.

    An audio clip's log-mel features are made when the encoder first reads them (`data`), not when the
    prompt is prepared: a clip whose rows the encoder cache holds, or whose tokens the prefix cache already
    covers, never needs them, and a conversation re-sends every earlier clip each turn (Whisper's features
    of a clip padded to 30 s cost ~7.5 ms whatever its length). What the prompt needs, its token count and
    frame count, comes from the clip's length; the clip was checked when the item was made."""

    modality: str  # "image" | "audio"
    mm_hash: str
    num_tokens: int  # placeholder tokens in the prompt
    # image: pixel_values [patches, C*T*P*P] + grid_thw [3]; audio: features [mel, frames], or None until read
    _data: torch.Tensor | None
    grid_thw: torch.Tensor | None = None
    offset: int = -1  # first placeholder token in the prompt, set by expand_placeholders
    frames: int = 0  # audio: valid mel frames (one per hop started)
    _make: Callable[[], torch.Tensor] | None = None  # audio: makes the features (a picklable partial)

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data, self._make = self._make(), None
        return self._data


def load_preprocess_config(model_path: Path) -> dict[str, Any]:
    cfg = dict(PREPROCESS_DEFAULTS)
    f = Path(model_path) / "omni_preprocess.json"
    if f.is_file():
        cfg.update(json.loads(f.read_text()))
    return cfg


def mm_hash(inp: MultiModalInput) -> str:
    data = np.ascontiguousarray(np.asarray(inp.data))
    h = xxhash.xxh3_128()
    h.update(f"{inp.modality}|{data.dtype.str}|{data.shape}|{inp.sampling_rate}|".encode())
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of `factor`, area within [min, max] pixels
    (h, w >= 1 and aspect ratio < 200: checked by preprocess_image)."""
    rh, rw = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if rh * rw > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        rh, rw = max(factor, math.floor(h / beta / factor) * factor), max(factor, math.floor(w / beta / factor) * factor)
    elif rh * rw < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        rh, rw = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return rh, rw


_IMAGE_PROCESSORS: dict[tuple, Any] = {}
_IMAGE_KEYS = ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size", "min_pixels",
               "max_pixels")


def hf_image_processor(cfg: dict[str, Any]) -> Any | None:
    """transformers' Qwen2-VL image processor (Pillow backend) for these settings, or None when
    Pillow or that backend is missing. One instance per distinct setting (they are stateless)."""
    key = tuple(json.dumps(cfg[k]) for k in _IMAGE_KEYS)
    if key not in _IMAGE_PROCESSORS:
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
            from transformers.utils import is_vision_available
        except ImportError:
            proc = None
        else:
            proc = Qwen2VLImageProcessorPil(**{k: cfg[k] for k in _IMAGE_KEYS}) if is_vision_available() else None
        _IMAGE_PROCESSORS[key] = proc
    return _IMAGE_PROCESSORS[key]


def preprocess_image(image: np.ndarray, cfg: dict[str, Any],
                     where: str = "multi_modal_data.image") -> tuple[torch.Tensor, torch.Tensor]:
    """HxWxC (uint8 0..255 or float 0..1) -> (pixel_values [patches, C*T*P*P], grid_thw [3])."""
    arr = check_image(image, where)
    if max(arr.shape[:2]) / min(arr.shape[:2]) > 200:
        raise RequestError(f"{where}: aspect ratio must be < 200, got {arr.shape[0]}x{arr.shape[1]}", field=where)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    arr = arr[..., :3] if arr.shape[-1] != 1 else np.repeat(arr, 3, axis=-1)
    proc = hf_image_processor(cfg)
    if proc is not None:
        # Integers are 0..255 (check_image); the processor wants uint8 for them and no rescale for 0..1 floats.
        integer = np.issubdtype(arr.dtype, np.integer)
        arr = np.ascontiguousarray(arr.astype(np.uint8) if integer else arr.astype(np.float32))
        # HxWxC, said so: left to guess, transformers reads a tiny image (1x1x3, 3xWx3) as channels-first
        out = proc(images=[arr], do_rescale=integer, input_data_format="channels_last", return_tensors="pt")
        return out["pixel_values"].float().contiguous(), out["image_grid_thw"][0].long()
    x = torch.from_numpy(np.ascontiguousarray(arr)).float()
    if np.issubdtype(arr.dtype, np.integer):
        x = x / 255.0
    x = x.permute(2, 0, 1)  # C, H, W
    ps, tps, m = cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]
    h, w = smart_resize(x.shape[1], x.shape[2], ps * m, cfg["min_pixels"], cfg["max_pixels"])
    if (h, w) != tuple(x.shape[1:]):
        x = torch.nn.functional.interpolate(x[None], size=(h, w), mode="bicubic", align_corners=False,
                                            antialias=True)[0].clamp(0, 1)
    mean = torch.tensor(cfg["image_mean"]).view(3, 1, 1)
    std = torch.tensor(cfg["image_std"]).view(3, 1, 1)
    x = (x - mean) / std
    patches = x[None].repeat(tps, 1, 1, 1)  # one image = one temporal patch of identical frames
    gt, gh, gw = 1, h // ps, w // ps
    patches = patches.reshape(gt, tps, 3, gh // m, m, ps, gw // m, m, ps)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(gt * gh * gw, 3 * tps * ps * ps).contiguous()
    return flat, torch.tensor([gt, gh, gw], dtype=torch.long)


_FEATURE_EXTRACTORS: dict[int, Any] = {}


def _feature_extractor(cfg: dict[str, Any]) -> Any:
    from transformers import WhisperFeatureExtractor

    fe = _FEATURE_EXTRACTORS.get(cfg["num_mel_bins"])
    if fe is None:
        fe = _FEATURE_EXTRACTORS[cfg["num_mel_bins"]] = WhisperFeatureExtractor(
            feature_size=cfg["num_mel_bins"], sampling_rate=cfg["audio_sampling_rate"], return_attention_mask=True)
    return fe


def checked_audio(wave: np.ndarray, sampling_rate: int | None, cfg: dict[str, Any],
                  where: str = "multi_modal_data.audio") -> np.ndarray:
    """The waveform as the encoder takes it (mono float32 at the model's rate, one Whisper window of
    n_fft samples up to 30 s), or the RequestError naming what is wrong."""
    sr = cfg["audio_sampling_rate"]
    # one Whisper window (n_fft) at least
    wave = check_audio(wave, sampling_rate, sr, 400, where)
    limit = _feature_extractor(cfg).n_samples
    # The encoder sees one window (30 s): the extractor would silently drop the rest, so longer audio is
    # refused, by its length alone, before any copy or mel frame of it is made.
    if wave.shape[0] > limit:
        raise RequestError(f"{where}: {wave.shape[0] / sr:g} s of audio ({wave.shape[0]} samples at {sr} Hz), "
                           f"longer than the {limit / sr:g} s ({limit} samples) the audio encoder takes; "
                           "send it as several clips", field=where)
    return wave.astype(np.float32)


def audio_frames(wave: np.ndarray) -> int:
    """Valid log-mel frames of a checked clip (the extractor's attention mask: one per hop started)."""
    return -(-wave.shape[0] // WHISPER_HOP)


def audio_features(wave: np.ndarray, cfg: dict[str, Any]) -> torch.Tensor:
    """A checked clip -> log-mel features [mel, valid frames], as transformers' processor makes them."""
    fe = _feature_extractor(cfg)
    out = fe(wave, sampling_rate=cfg["audio_sampling_rate"], padding="max_length", return_attention_mask=True,
             return_tensors="np")
    n = int(out["attention_mask"][0].sum())
    return torch.from_numpy(out["input_features"][0, :, :n].copy())


def preprocess_audio(wave: np.ndarray, sampling_rate: int | None, cfg: dict[str, Any],
                     where: str = "multi_modal_data.audio") -> torch.Tensor:
    """Waveform (mono, at the model's sampling rate) -> log-mel features [mel, valid frames]."""
    return audio_features(checked_audio(wave, sampling_rate, cfg, where), cfg)


def audio_item(inp: MultiModalInput, cfg: dict[str, Any], num_tokens: Callable[[int], int], where: str) -> MMItem:
    """An audio input checked now, its features made when the encoder reads them (MMItem)."""
    wave = checked_audio(inp.data, inp.sampling_rate, cfg, where)
    frames = audio_frames(wave)
    return MMItem("audio", mm_hash(inp), num_tokens(frames), None, frames=frames,
                  _make=functools.partial(audio_features, wave, cfg))


WHISPER_HOP = 160  # samples per mel frame of WhisperFeatureExtractor (its hop_length)


def audio_num_tokens(num_frames: int) -> int:
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def mm_num_tokens(inp: MultiModalInput, cfg: dict[str, Any]) -> int:
    """The placeholder tokens `inp` will take (what `preprocess_mm` makes of it), from its shape alone: a
    prompt whose media alone overflow the model is refused before any pixel value or mel frame is made.
    0 for an input that is not an image / audio array: `preprocess_mm` names what is wrong with it."""
    try:
        shape = np.shape(inp.data)
    except ValueError:  # ragged nested lists
        return 0
    if inp.modality == "image" and len(shape) in (2, 3) and min(shape[:2]) >= 1:
        ps, m = cfg["patch_size"], cfg["merge_size"]
        h, w = smart_resize(shape[0], shape[1], ps * m, cfg["min_pixels"], cfg["max_pixels"])
        return (h // ps) * (w // ps) // m**2
    if inp.modality == "audio" and len(shape) == 1 and shape[0] > 0:
        return audio_num_tokens(-(-shape[0] // WHISPER_HOP))  # valid mel frames: one per hop started
    return 0


def preprocess_mm(inp: MultiModalInput, cfg: dict[str, Any], where: str = "multi_modal_data") -> MMItem:
    if inp.modality == "image":
        pixels, grid = preprocess_image(inp.data, cfg, where)
        n = int(grid.prod()) // cfg["merge_size"] ** 2
        return MMItem("image", mm_hash(inp), n, pixels, grid)
    if inp.modality == "audio":
        return audio_item(inp, cfg, audio_num_tokens, where)
    raise RequestError(f"{where}: modality must be 'image' or 'audio', got {inp.modality!r}", field=where)


def content_text(content: Any, where: str, model: str, image_placeholder: str, audio_placeholder: str) -> str:
    """A chat message's content as the omni chat templates write it: text parts joined, an image or audio part as
    its placeholder (the thinker then repeats the pad once per encoder row); None (an assistant turn of tool
    calls only) is empty."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return str(content)
    text = ""
    for j, item in enumerate(content):
        kind = item.get("type", "text")
        if kind == "image":
            text += image_placeholder
        elif kind == "audio":
            text += audio_placeholder
        elif kind == "text":
            text += item.get("text", "")
        else:
            raise RequestError(f"{where}.content[{j}].type: the {model} thinker takes text, image and audio (got "
                               f"{kind!r}; video inputs are not supported yet)", field=f"{where}.content[{j}].type")
    return text


def render_chat(messages: list[dict[str, Any]], system_prompt: str) -> str:
    """Qwen2.5-Omni's chat format; image/audio parts become one placeholder each."""
    parts = []
    if not messages or messages[0].get("role") != "system":
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    for i, msg in enumerate(messages):
        content = content_text(msg.get("content"), f"prompt[{i}]", "Qwen2.5-Omni", IMAGE_PLACEHOLDER,
                               AUDIO_PLACEHOLDER)
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def messages_for(prompt: str | list[dict[str, Any]], mm_inputs: list[MultiModalInput]) -> list[dict[str, Any]]:
    """A text prompt becomes one user message; media without a placeholder go first in the last user turn."""
    if not isinstance(prompt, str):
        check_messages(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    text = json.dumps([m.get("content") for m in messages], default=str)
    have = text.count(IMAGE_TOKEN) + text.count(AUDIO_TOKEN) + text.count('"type": "image"') \
        + text.count('"type": "audio"')
    if mm_inputs and have == 0:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise RequestError("multi_modal_data: the messages have no user turn to attach the media to",
                               field="multi_modal_data")
        user = users[-1]
        c = messages[user].get("content", "")
        media = [{"type": m.modality} for m in mm_inputs]
        c = c if isinstance(c, list) else [{"type": "text", "text": c}]
        messages[user]["content"] = media + c
    return messages


def expand_placeholders(ids: list[int], items: list[MMItem], image_id: int, audio_id: int) -> list[int]:
    """Replace the k-th image (audio) placeholder id by the k-th image (audio) item's token count.

    Items are matched per modality, in order (as transformers' processor does); sets their offsets."""
    queues = {image_id: [i for i in items if i.modality == "image"],
              audio_id: [i for i in items if i.modality == "audio"]}
    used = {image_id: 0, audio_id: 0}
    out: list[int] = []
    for t in ids:
        if t in queues:
            k = used[t]
            if k >= len(queues[t]):
                kind = "image" if t == image_id else "audio"
                raise RequestError(f"prompt: more {kind} placeholders than {kind} mm_inputs ({len(queues[t])})",
                                   field="prompt")
            item = queues[t][k]
            item.offset = len(out)
            out.extend([t] * item.num_tokens)
            used[t] = k + 1
        else:
            out.append(t)
    for t, kind in ((image_id, "image"), (audio_id, "audio")):
        if used[t] != len(queues[t]):
            raise RequestError(f"prompt: {len(queues[t])} {kind} mm_inputs but {used[t]} {kind} placeholders",
                               field="prompt")
    return out


def fill_mrope_positions(pos3: torch.Tensor, row: int, start: int, end: int,
                         prompt_positions: torch.Tensor, delta: int) -> None:
    """Write one request's 3-D rotary positions for its scheduled span [start, end)
    into the packed batch's `pos3[:, row : row + end - start]`: prompt tokens take
    their precomputed (text/image/audio) positions, generated tokens continue
    text-style, shifted by the request's `delta` (as transformers' get_rope_index)."""
    num_prompt = prompt_positions.shape[1]
    stop = min(end, num_prompt)
    if start < stop:
        pos3[:, row : row + stop - start] = prompt_positions[:, start:stop]
    if end > num_prompt:
        first = max(start, num_prompt)
        pos3[:, row + first - start : row + end - start] = torch.arange(first, end) + delta
