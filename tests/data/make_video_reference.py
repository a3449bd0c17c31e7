"""Writes tests/data/video/*.mp4 and tests/data/video_reference.npz: what transformers' own Qwen2.5-Omni and
Qwen3-Omni processors make of a few tiny videos (their Qwen2-VL video processor: frame sampling, resize,
normalisation, patches; the prompt ids with the video placeholders expanded, with and without the audio track
interleaved), for tests/stages/test_video_reference.py to check our torch/numpy video path against.

transformers' video processors import torchvision, which does not import beside the project's CPU torch, so this
runs ONCE, in a separate environment, and its outputs are committed (tests only read them):

    python3.11 -m venv /tmp/tvenv
    /tmp/tvenv/bin/pip install --find-links /opt/pypi-more/files torch==2.14.1 torchvision==0.29.1 \
        transformers==5.23.0 av==18.1.0 pillow numpy
    /tmp/tvenv/bin/python tests/data/make_video_reference.py \
        --qwen2-5 ~/.cache/omni/tiny-qwen2_5-omni-v3 --qwen3 ~/.cache/omni/tiny-qwen3-omni-v2

(the two folders: the tiny checkpoints, `python -m stages.qwen2_5_omni.checkpoint` and
`python -m stages.qwen3_omni.checkpoint` print theirs; only their tokenizers are read). The videos are made here
with PyAV (mpeg4 + aac in mp4), decoded here with PyAV (frames as rgb24, the audio track resampled to 16 kHz mono
float32) and handed to the processors as arrays with their metadata, with `do_sample_frames=True` at the
processor's fps (the fps its `video_second_per_grid` assumes). Pixel values are large next to everything else,
so the file keeps their shape, sha256 and three rows; prompt ids, grids, frame indices and the audio features'
digests are kept whole.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

HERE = Path(__file__).resolve().parent
VIDEOS = HERE / "video"

# name -> (frames, height, width, fps, audio seconds or 0)
CLIPS = {
    "plain": (9, 40, 60, 4, 0.0),  # an odd count of frames, no audio track
    "talk": (14, 36, 52, 5, 2.8),  # with an audio track (stereo 44.1 kHz, resampled to 16 kHz mono)
    "long": (25, 30, 44, 6, 4.1),  # several seconds: more than one 2 s chunk of interleaved audio and video
}

QWEN2_5_SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                  "auditory and visual inputs, as well as generating text and speech.")


def make_clip(name: str) -> bytes:
    frames, h, w, fps, seconds = CLIPS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        v = out.add_stream("mpeg4", rate=fps)
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        v.options = {"qscale": "3"}
        if seconds:  # every stream is added before the first packet is written
            a = out.add_stream("aac", rate=44100)
            a.layout = "stereo"
        yy, xx = np.mgrid[0:h, 0:w]
        for k in range(frames):  # a moving gradient with a little noise: every frame differs
            r = (xx * 4 + k * 9) % 256
            g = (yy * 5 + k * 13) % 256
            b = ((xx + yy) * 3 + k * 21) % 256
            img = np.stack([r, g, b], -1).astype(np.int16) + rng.integers(-12, 13, (h, w, 3))
            frame = av.VideoFrame.from_ndarray(np.clip(img, 0, 255).astype(np.uint8), format="rgb24")
            for packet in v.encode(frame):
                out.mux(packet)
        for packet in v.encode():
            out.mux(packet)
        if seconds:
            t = np.arange(int(44100 * seconds)) / 44100
            wave = np.stack([0.3 * np.sin(2 * np.pi * 330 * t), 0.2 * np.sin(2 * np.pi * 523 * t)])
            wave = (wave + 0.02 * rng.standard_normal(wave.shape)).astype(np.float32)
            for start in range(0, wave.shape[1], 1024):
                chunk = np.ascontiguousarray(wave[:, start : start + 1024])
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                frame.sample_rate, frame.pts, frame.time_base = 44100, start, Fraction(1, 44100)
                for packet in a.encode(frame):
                    out.mux(packet)
            for packet in a.encode():
                out.mux(packet)
    return buf.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, float, np.ndarray | None]:
    """All frames (T, H, W, 3 uint8), the stream's average fps, and the audio track at 16 kHz mono float32."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        fps = float(stream.average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)])
    with av.open(io.BytesIO(data)) as c:
        if not c.streams.audio:
            return frames, fps, None
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        parts = [r.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0]) for r in resampler.resample(f)]
        parts += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return frames, fps, np.concatenate(parts).astype(np.float32)


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def processors(q25_dir: Path, q3_dir: Path) -> dict:
    from transformers import (AutoTokenizer, Qwen2_5OmniProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor,
                              Qwen3OmniMoeProcessor, WhisperFeatureExtractor)

    clip = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    # What the checkpoints' preprocessor_config.json give the image and video processors (the video processor is
    # built from that file too: neither checkpoint ships a video one)
    q25 = dict(clip, patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056)
    q3 = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, patch_size=16, temporal_patch_size=2, merge_size=2,
              min_pixels=3136, max_pixels=12845056)
    q3_tokens = dict(image_token="<|image_pad|>", video_token="<|video_pad|>", audio_token="<|audio_pad|>",
                     vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
                     audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
    q3_tok = AutoTokenizer.from_pretrained(str(q3_dir), extra_special_tokens=q3_tokens)
    return {
        "q25": Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(**q25),
                                    video_processor=Qwen2VLVideoProcessor(**q25),
                                    feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                    tokenizer=AutoTokenizer.from_pretrained(str(q25_dir))),
        "q3": Qwen3OmniMoeProcessor(image_processor=Qwen2VLImageProcessor(**q3),
                                    video_processor=Qwen2VLVideoProcessor(**q3),
                                    feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=q3_tok),
    }


def prompt(family: str) -> str:
    if family == "q25":
        return (f"<|im_start|>system\n{QWEN2_5_SYSTEM}<|im_end|>\n<|im_start|>user\n"
                "<|vision_bos|><|VIDEO|><|vision_eos|>What happens here?<|im_end|>\n<|im_start|>assistant\n")
    return ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens here?<|im_end|>\n"
            "<|im_start|>assistant\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen2-5", required=True, type=Path)
    ap.add_argument("--qwen3", required=True, type=Path)
    args = ap.parse_args()
    VIDEOS.mkdir(exist_ok=True)
    procs = processors(args.qwen2_5.expanduser(), args.qwen3.expanduser())
    # The processors' own fps (the one their `video_second_per_grid` assumes) and the model configs'
    # position_id_per_seconds (the tiny checkpoints': 25 for both; the real 30B Qwen3-Omni's is 13, the processor's)
    fps = {"q25": 2.0, "q3": 1.0}
    pos_per_s = {"q25": 25, "q3": 25}
    out: dict[str, np.ndarray] = {}
    for name in CLIPS:
        data = make_clip(name)
        (VIDEOS / f"{name}.mp4").write_bytes(data)
        frames, src_fps, wave = decode(data)
        out[f"{name}.frames_sha"] = np.array(sha(frames))
        out[f"{name}.frames_shape"] = np.array(frames.shape)
        out[f"{name}.fps"] = np.array(src_fps)
        if wave is not None:
            out[f"{name}.wave_sha"] = np.array(sha(wave))
            out[f"{name}.wave_len"] = np.array(wave.shape[0])
        for family, proc in procs.items():
            for with_audio in (False, True) if wave is not None else (False,):
                key = f"{family}.{name}.{'av' if with_audio else 'v'}"
                kw = dict(videos=[frames], video_metadata=[{"total_num_frames": len(frames), "fps": src_fps,
                                                            "duration": len(frames) / src_fps}],
                          videos_kwargs={"do_sample_frames": True, "fps": fps[family], "cap_pixels_per_frame": False},
                          position_id_per_seconds=pos_per_s[family], return_metadata=True, return_tensors="pt")
                if with_audio:
                    kw.update(audio=[wave], audio_from_video_indices=[0], load_audio_from_video=True)
                res = proc(text=[prompt(family)], **kw)
                pv = res["pixel_values_videos"].float().numpy()
                out[f"{key}.input_ids"] = res["input_ids"][0].numpy()
                out[f"{key}.grid"] = res["video_grid_thw"][0].numpy()
                out[f"{key}.second_per_grid"] = np.array(res["video_second_per_grid"], dtype=np.float64)
                out[f"{key}.frames_indices"] = np.asarray(res["video_metadata"][0].frames_indices)
                out[f"{key}.pixels_sha"] = np.array(sha(pv))
                out[f"{key}.pixels_shape"] = np.array(pv.shape)
                out[f"{key}.pixels_rows"] = pv[[0, pv.shape[0] // 2, -1]]
                if with_audio:
                    valid = int(res["feature_attention_mask"][0].sum())
                    feats = res["input_features"][0, :, :valid].float().numpy()
                    out[f"{key}.audio_frames"] = np.array(valid)
                    out[f"{key}.features_sha"] = np.array(sha(feats))
                    out[f"{key}.features_cols"] = feats[:, [0, valid // 2, valid - 1]]
        out["prompt.q25"], out["prompt.q3"] = np.array(prompt("q25")), np.array(prompt("q3"))
    np.savez_compressed(HERE / "video_reference.npz", **out)
    sizes = {p.name: p.stat().st_size for p in sorted(VIDEOS.iterdir())}
    print(json.dumps({"npz": (HERE / "video_reference.npz").stat().st_size, **sizes}))


if __name__ == "__main__":
    main()
