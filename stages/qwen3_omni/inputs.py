"""Qwen3-Omni prompts: the chat format, media placement in the messages, and each input's encoder inputs.

    render_chatml   ChatML as Qwen3-Omni's chat template writes it; an image part becomes
                    <|vision_start|><|image_pad|><|vision_end|>, an audio part
                    <|audio_start|><|audio_pad|><|audio_end|> (the thinker then repeats the pad once per
                    encoder output row); tools, tool calls and tool results in Qwen3's function-calling
                    format (what `--tool-call-parser hermes` reads back)
    chat_messages   a text prompt or messages, with media that have no placeholder part put first in the
                    last user turn (as Qwen2.5-Omni's stage does)
    media_item      an image: Qwen2-VL's Pillow image processor at the vision tower's patching, mean/std 0.5
                    (Qwen3-Omni's preprocessor settings); a clip: Whisper log-mel features of the clip alone (as
                    Qwen3OmniMoeProcessor pads: to the longest clip) and transformers'
                    `_get_feat_extract_output_lengths` for its number of rows
    video_settings_of  Qwen3OmniMoeProcessor's video path (stages/common/video.py): the image settings, frames
                    between 128 and 768 merge patches of pixels, sampled at 1 fps (the rate its
                    video_second_per_grid assumes)
"""
from __future__ import annotations

import json
from typing import Any

import torch

from omni.errors import RequestError
from omni.messages import MultiModalInput

from stages.common.audio_features import audio_item
from stages.common.images import preprocess_image
from stages.common.mm_items import MMItem, content_text, mm_hash
from stages.common.video import video_settings

AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
# Qwen3OmniMoeProcessor's videos_kwargs (its frames' pixel bounds) and the fps its video_second_per_grid assumes
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_FPS = 128 * 32 * 32, 768 * 32 * 32, 1.0
# Qwen3's chat template (and Qwen2.5's) around the tools' JSON, one tool a line, in the system turn
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n")
# Qwen3-Omni's Whisper feature extractor, as its processor calls it (padding=True: a clip alone is not padded)
AUDIO_CONFIG = {"audio_sampling_rate": 16000, "num_mel_bins": 128, "audio_padding": "longest"}


def image_config(vision_config: Any, max_pixels: int) -> dict[str, Any]:
    """Qwen3-Omni's image processor settings: Qwen2-VL's with the vision tower's patching, mean/std 0.5."""
    return {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": vision_config.patch_size,
            "temporal_patch_size": vision_config.temporal_patch_size, "merge_size": vision_config.spatial_merge_size,
            "min_pixels": 56 * 56, "max_pixels": max_pixels}


def video_settings_of(image_cfg: dict[str, Any], fps: float = VIDEO_FPS) -> dict[str, Any]:
    """Qwen3-Omni's video processor settings (stages/common/video.py) next to its image settings."""
    return video_settings(image_cfg, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, fps)


def _text_of(content: Any, where: str) -> str:
    return content_text(content, where, "Qwen3-Omni", PLACEHOLDERS)


def _tojson(value: Any) -> str:
    """transformers' chat-template `tojson` filter (json.dumps, non-ASCII kept, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def _tool_call(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments")
    return ('<tool_call>\n{"name": "' + str(fn.get("name")) + '", "arguments": '
            + (args if isinstance(args, str) else _tojson(args)) + "}\n</tool_call>")


def render_chatml(messages: list[dict[str, Any]], system_prompt: str | None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """Qwen3-Omni's chat format, ending with the assistant's generation prompt. With tools, Qwen3's (and
    Qwen2.5's) function-calling format: the tools' JSON in the system turn, an assistant's calls as
    <tool_call> blocks, the tools' results as <tool_response> blocks of one user turn."""
    parts = []
    first_system = bool(messages) and messages[0].get("role") == "system"
    if tools:
        parts.append("<|im_start|>system\n")
        if first_system:
            parts.append(_text_of(messages[0].get("content"), "prompt[0]") + "\n\n")
        elif system_prompt:
            parts.append(system_prompt + "\n\n")
        parts.append(TOOLS_HEADER + "".join("\n" + _tojson(t) for t in tools) + TOOLS_FOOTER)
    elif system_prompt and not first_system:
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    for i, msg in enumerate(messages):
        role, where = msg["role"], f"prompt[{i}]"
        content = _text_of(msg.get("content"), where)
        if role == "system" and i == 0 and tools:
            continue  # written above, with the tools
        if role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                parts.append("<|im_end|>\n")
            continue
        if role == "assistant" and msg.get("tool_calls"):
            calls = [("\n" if k or content else "") + _tool_call(c) for k, c in enumerate(msg["tool_calls"])]
            parts.append(f"<|im_start|>assistant\n{content}{''.join(calls)}<|im_end|>\n")
            continue
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def chat_messages(prompt: Any, modalities: list[str]) -> list[dict[str, Any]]:
    """Chat messages of a prompt; media with no placeholder part go first in the last user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RequestError("prompt: give a string or a list of chat messages ({'role', 'content'})", field="prompt")
    placed = sum(1 for m in messages if isinstance(m.get("content"), list)
                 for part in m["content"] if isinstance(part, dict) and part.get("type") in PLACEHOLDERS)
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
