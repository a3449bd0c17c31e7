"""Qwen3-Omni prompts: the chat format, media placement in the messages, and each input's encoder inputs.

    render_chatml   ChatML as Qwen3-Omni's chat template writes it; an image part becomes
                    <|vision_start|><|image_pad|><|vision_end|>, an audio part
                    <|audio_start|><|audio_pad|><|audio_end|> (the thinker then repeats the pad once per
                    encoder output row)
    chat_messages   a text prompt or messages, with media that have no placeholder part put first in the
                    last user turn (as Qwen2.5-Omni's stage does)
    media_item      an image: Qwen2-VL's Pillow image processor at the vision tower's patching, mean/std 0.5
                    (Qwen3-Omni's preprocessor settings); a clip: Whisper log-mel features and transformers'
                    `_get_feat_extract_output_lengths` for its number of rows
"""
from __future__ import annotations

from typing import Any

import torch

from omni.errors import RequestError
from omni.outputs import MultiModalInput

from .qwen2_5_omni_inputs import MMItem, audio_item, mm_hash, preprocess_image

AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_CONFIG = {"audio_sampling_rate": 16000, "num_mel_bins": 128}  # Qwen3-Omni's Whisper feature extractor


def image_config(vision_config: Any, max_pixels: int) -> dict[str, Any]:
    """Qwen3-Omni's image processor settings: Qwen2-VL's with the vision tower's patching, mean/std 0.5."""
    return {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": vision_config.patch_size,
            "temporal_patch_size": vision_config.temporal_patch_size, "merge_size": vision_config.spatial_merge_size,
            "min_pixels": 56 * 56, "max_pixels": max_pixels}


def render_chatml(messages: list[dict[str, Any]], system_prompt: str | None) -> str:
    """Qwen3-Omni's chat format for text messages, ending with the assistant's generation prompt."""
    parts = []
    if system_prompt and (not messages or messages[0].get("role") != "system"):
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    for i, msg in enumerate(messages):
        content = msg.get("content", "")
        if isinstance(content, list):
            text = ""
            for j, item in enumerate(content):
                kind = item.get("type", "text")
                if kind == "audio":
                    text += AUDIO_PLACEHOLDER
                elif kind == "image":
                    text += IMAGE_PLACEHOLDER
                elif kind == "text":
                    text += item.get("text", "")
                else:
                    raise RequestError(f"prompt[{i}].content[{j}].type: the Qwen3-Omni thinker takes text, image and "
                                       f"audio (got {kind!r}; video inputs are not supported yet)",
                                       field=f"prompt[{i}].content[{j}].type")
            content = text
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def chat_messages(prompt: Any, modalities: list[str]) -> list[dict[str, Any]]:
    """Chat messages of a prompt; media with no placeholder part go first in the last user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RequestError("prompt: give a string or a list of chat messages ({'role', 'content'})", field="prompt")
    placed = sum(1 for m in messages if isinstance(m.get("content"), list)
                 for part in m["content"] if isinstance(part, dict) and part.get("type") in ("audio", "image"))
    if modalities and not placed:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise RequestError("multi_modal_data: the messages have no user turn to attach the media to",
                               field="multi_modal_data")
        messages = [dict(m) for m in messages]
        content = messages[users[-1]].get("content", "")
        text = content if isinstance(content, list) else [{"type": "text", "text": content}]
        messages[users[-1]]["content"] = [{"type": m} for m in modalities] + text
    return messages


def media_item(inp: MultiModalInput, where: str, image_cfg: dict[str, Any], audio_n_window: int,
               max_model_len: int) -> MMItem:
    """An input's encoder inputs and its number of placeholder tokens (the encoder's output rows)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    if inp.modality == "image":
        pixels, grid = preprocess_image(inp.data, image_cfg, where)
        item = MMItem("image", mm_hash(inp), int(grid.prod()) // image_cfg["merge_size"] ** 2, pixels, grid)
    else:
        item = audio_item(inp, AUDIO_CONFIG, lambda frames: int(_get_feat_extract_output_lengths(
            torch.tensor(frames), audio_n_window)), where)
    if item.num_tokens > max_model_len:
        raise RequestError(f"{where}: the input takes {item.num_tokens} placeholder tokens, more than the model's "
                           f"{max_model_len} positions", field=where)
    return item
