"""Video frames -> vision-tower inputs, as transformers' Qwen2-VL video processor makes them (the video processor of
both Qwen2.5-Omni and Qwen3-Omni), in torch alone.

transformers' video processors import torchvision, which does not import beside our CPU torch, so this is a port of
`Qwen2VLVideoProcessor` (`sample_frames`, `resize`, `rescale_and_normalize`, `patchify`) on the torch ops it calls:

    sample_indices     `sample_frames` with `fps`: a video's own frame rate resampled to the model's `fps`,
                       between `min_frames` and `max_frames`, a multiple of the temporal patch
    preprocess_video   resize to multiples of patch * merge within [min_pixels, max_pixels] (Qwen2-VL's
                       smart_resize; torchvision's uint8 bicubic antialiased resize is torch's own
                       `interpolate` on the uint8 frames), rescale + normalise fused as transformers does
                       (mean and std times 255), the last frame repeated up to a multiple of the temporal patch,
                       patches ordered by temporal patch then 2x2 merge group

tests/stages/test_video_reference.py checks both against transformers' own processor on committed videos (the
reference made once in an environment with torchvision: tests/data/make_video_reference.py): bit for bit.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from omni.errors import RequestError

from stages.common.images import smart_resize

RESCALE = 1 / 255  # transformers' rescale_factor


def video_settings(image_cfg: dict[str, Any], min_pixels: int, max_pixels: int, fps: float,
                   min_frames: int = 4, max_frames: int = 768) -> dict[str, Any]:
    """A family's video processor settings: its image processor's patching and normalisation (both omni
    checkpoints build the video processor from the image processor's preprocessor_config.json), the pixel bounds
    its processor passes for videos, the fps its processor samples at and Qwen2-VL's frame bounds."""
    keys = ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size")
    return {**{k: image_cfg[k] for k in keys}, "min_pixels": int(min_pixels), "max_pixels": int(max_pixels),
            "fps": float(fps), "min_frames": int(min_frames), "max_frames": int(max_frames)}


def num_sampled(total: int, src_fps: float | None, cfg: dict[str, Any]) -> int:
    """How many frames `sample_indices` keeps of `total` (all of them without a frame rate)."""
    if src_fps is None:
        return total
    tps = cfg["temporal_patch_size"]
    max_frames = math.floor(min(cfg["max_frames"], total) / tps) * tps
    n = total / src_fps * cfg["fps"]
    n = min(max(n, cfg["min_frames"]), max_frames, total)
    return math.floor(n / tps) * tps


def sample_indices(total: int, src_fps: float | None, cfg: dict[str, Any], where: str) -> list[int]:
    """The frames Qwen2-VL's `sample_frames` keeps of a video of `total` frames at `src_fps` (None: every
    frame, as transformers keeps frames handed over without their frame rate)."""
    n = num_sampled(total, src_fps, cfg)
    if n < 1:
        raise RequestError(f"{where}: {total} frame(s); a video needs at least {cfg['temporal_patch_size']} "
                           "(one temporal patch)", field=where)
    if src_fps is None:
        return list(range(total))
    return torch.arange(0, total, total / n).int().tolist()


def video_grid(num_frames: int, height: int, width: int, cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(grid t, h, w) of `num_frames` sampled frames of height x width, from the sizes alone."""
    ps, tps, m = cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]
    h, w = smart_resize(height, width, ps * m, cfg["min_pixels"], cfg["max_pixels"])
    return -(-num_frames // tps), h // ps, w // ps


def preprocess_video(frames: np.ndarray, cfg: dict[str, Any], where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled frames [T, H, W, 3] uint8 -> (pixel_values_videos [patches, C*T*P*P] float32, grid_thw [3])."""
    t, height, width = frames.shape[:3]
    if max(height, width) / min(height, width) > 200:
        raise RequestError(f"{where}: aspect ratio must be < 200, got {height}x{width}", field=where)
    ps, tps, m = cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()  # T, C, H, W uint8
    h, w = smart_resize(height, width, ps * m, cfg["min_pixels"], cfg["max_pixels"])
    if (h, w) != (height, width):
        # torchvision's resize of uint8 frames on CPU: torch's native uint8 antialiased bicubic
        x = torch.nn.functional.interpolate(x, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(cfg["image_mean"]) * (1.0 / RESCALE)  # rescale fused into normalisation
    std = torch.tensor(cfg["image_std"]) * (1.0 / RESCALE)
    x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if pad := -t % tps:
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)), dim=0)
    gt, gh, gw = x.shape[0] // tps, h // ps, w // ps
    patches = x.view(1, gt, tps, 3, gh // m, m, ps, gw // m, m, ps).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(gt * gh * gw, 3 * tps * ps * ps).contiguous()
    return flat, torch.tensor([gt, gh, gw], dtype=torch.long)
