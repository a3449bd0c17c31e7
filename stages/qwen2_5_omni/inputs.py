"""Qwen2.5-Omni prompt building and its preprocessing settings (no model weights needed).

- `messages_for` + `render_chat`: chat messages (or text) -> the prompt text with one placeholder per
  image/audio; `expand_placeholders` (stages/common/mm_items.py) then expands each placeholder token to the
  number of tokens its encoder produces (the thinker's `preprocess` tokenizes in between).
- `preprocess_mm`: an image through Qwen2-VL's image processor (stages/common/images.py) at Qwen2.5-Omni's
  settings (CLIP normalisation, 28-pixel merge patches), an audio clip through Whisper's feature extractor
  (stages/common/audio_features.py, 128 mel bins); `mm_num_tokens` counts their tokens from shapes alone.
- `video_settings_of`: Qwen2.5-Omni's processor's video path (stages/common/video.py): the image processor's
  patching and normalisation, frames between 128 and 768 merge patches of pixels, sampled at 2 fps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from omni.errors import RequestError
from omni.messages import MultiModalInput
from omni.prompts import check_messages

from stages.common.audio_features import WHISPER_HOP, audio_item
from stages.common.images import preprocess_image, smart_resize
from stages.common.mm_items import MMItem, content_text, mm_hash
from stages.common.video import video_settings

IMAGE_TOKEN, AUDIO_TOKEN, VIDEO_TOKEN = "<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>"
IMAGE_PLACEHOLDER = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
VIDEO_PLACEHOLDER = "<|vision_bos|><|VIDEO|><|vision_eos|>"
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
# Qwen2_5OmniProcessor's videos_kwargs (its frames' pixel bounds) and the fps its video_second_per_grid assumes
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_FPS = 128 * 28 * 28, 768 * 28 * 28, 2.0
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


def load_preprocess_config(model_path: Path) -> dict[str, Any]:
    cfg = dict(PREPROCESS_DEFAULTS)
    f = Path(model_path) / "omni_preprocess.json"
    if f.is_file():
        cfg.update(json.loads(f.read_text()))
    return cfg


def video_settings_of(cfg: dict[str, Any], fps: float = VIDEO_FPS) -> dict[str, Any]:
    """Qwen2.5-Omni's video processor settings (stages/common/video.py) next to its image settings `cfg`."""
    return video_settings(cfg, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, fps)


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


def render_chat(messages: list[dict[str, Any]], system_prompt: str) -> str:
    """Qwen2.5-Omni's chat format; image/audio/video parts become one placeholder each."""
    parts = []
    if not messages or messages[0].get("role") != "system":
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    for i, msg in enumerate(messages):
        content = content_text(msg.get("content"), f"prompt[{i}]", "Qwen2.5-Omni", PLACEHOLDERS)
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def messages_for(prompt: str | list[dict[str, Any]], modalities: list[str]) -> list[dict[str, Any]]:
    """A text prompt becomes one user message; media (`modalities`: the prompt's media items, in order) without a
    placeholder go first in the last user turn."""
    if not isinstance(prompt, str):
        check_messages(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    text = json.dumps([m.get("content") for m in messages], default=str)
    have = sum(text.count(token) for token in (IMAGE_TOKEN, AUDIO_TOKEN, VIDEO_TOKEN)) \
        + sum(text.count(f'"type": "{kind}"') for kind in PLACEHOLDERS)
    if modalities and have == 0:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise RequestError("multi_modal_data: the messages have no user turn to attach the media to",
                               field="multi_modal_data")
        user = users[-1]
        c = messages[user].get("content", "")
        media = [{"type": m} for m in modalities]
        c = c if isinstance(c, list) else [{"type": "text", "text": c}]
        messages[user]["content"] = media + c
    return messages


