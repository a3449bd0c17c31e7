"""Image preprocessing as Qwen2-VL's image processor does it (Qwen2.5-Omni and Qwen3-Omni, with their settings).

With Pillow installed (it is pinned), transformers' own Qwen2-VL image processor (its Pillow backend: the
processor the omni processors use without torchvision), so pixel values equal the reference processor's bit for
bit. Without Pillow (or a transformers that lacks that backend), a torch port of the same patchification (resize
to multiples of patch * merge within min/max pixels, normalisation, temporal patch of 2, patches ordered by 2x2
merge groups) whose bicubic resize may differ from Pillow's by rounding.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from omni.errors import RequestError

from stages.common.media import check_image


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
