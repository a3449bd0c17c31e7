"""Writes tests/data/higgs_codec_reference.npz: what transformers' own `HiggsAudioV2TokenizerModel` makes of
real recorded speech with our tiny random codec checkpoints (stages/higgs_audio_v2/codec_checkpoint.py), for
tests/stages/higgs_audio_v2/test_codec_model.py to check our torchaudio-free codec against.

transformers' codec imports torchaudio at module level, which does not load beside the project's torch, so this
runs ONCE, in a separate environment, and its output is committed (tests only read it). The commands are in
tests/data/README.md.

The speech: 3 s of Moonshine's sample recording (16 kHz, 16-bit), kept whole in the file; resampled to 24 kHz
with torchaudio (what the processor's callers do before its DacFeatureExtractor, which takes 24 kHz only) and
passed through that feature extractor as HiggsAudioV2Processor does before `encode`. Stored per checkpoint: the
digest of the tensors the recipe wrote (the test's build must equal it) and of those transformers'
`save_pretrained` writes back (equal: same keys, same tensors), the config.json it writes, the codes, every
16th sample of the codes' decode plus its first 1000, and a short decode of the first frames in full. And
torchaudio's resampler on pieces of the clip, both ways, against which our resampler is checked.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import torch
import torchaudio
from transformers import DacFeatureExtractor, HiggsAudioV2TokenizerModel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from stages.higgs_audio_v2.codec_checkpoint import state_digest, write_higgs_codec  # noqa: E402
from stages.higgs_audio_v2.codec_weights import read_safetensors  # noqa: E402

CLIP_START_S, CLIP_S = 0.5, 3.0
SIZES = ("tiny", "tiny8")
SHORT_SAMPLES = 5760  # the short decode: the first frames that make this many samples (12 tiny / 6 tiny8)
STRIDE = 16  # every STRIDE-th sample of the whole decode is kept


def read_clip(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    start = int(CLIP_START_S * 16000)
    return pcm[start : start + int(CLIP_S * 16000)].copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wav", type=Path, help="moonshine_onnx/assets/beckett.wav")
    parser.add_argument("--out", type=Path, default=HERE / "higgs_codec_reference.npz")
    args = parser.parse_args()
    torch.set_num_threads(1)

    clip = read_clip(args.wav)
    x16 = torch.from_numpy(clip.astype(np.float32) / 32768.0)
    wave24 = torchaudio.functional.resample(x16, 16000, 24000)
    out: dict[str, np.ndarray] = {
        "clip_pcm16": clip,
        "resample_up_in": x16[:4000].numpy(),  # 0.25 s at 16 kHz ...
        "resample_up_out": torchaudio.functional.resample(x16[:4000], 16000, 24000).numpy(),  # ... at 24 kHz
        "resample_down_in": wave24[:6000].numpy(),
        "resample_down_out": torchaudio.functional.resample(wave24[:6000], 24000, 16000).numpy(),
        "wave24_head": wave24[:6000].numpy(),  # the whole-clip resample: its head and every 50th sample
        "wave24_every50": wave24[::50].numpy(),
        "versions": np.array(json.dumps({"torch": torch.__version__, "torchaudio": torchaudio.__version__,
                                         "transformers": __import__("transformers").__version__})),
    }
    for size in SIZES:
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as saved:
            info = write_higgs_codec(size, tmp)
            model = HiggsAudioV2TokenizerModel.from_pretrained(tmp, dtype=torch.float32).eval()
            fe = DacFeatureExtractor(feature_size=1, sampling_rate=24000, hop_length=model.config.hop_length)
            inputs = fe(wave24.numpy(), sampling_rate=24000, padding=False, return_tensors="pt")
            inputs.pop("padding_mask", None)
            assert torch.equal(inputs["input_values"][0, 0], wave24)
            with torch.no_grad():
                codes = model.encode(**inputs).audio_codes
                audio = model.decode(codes).audio_values[0, 0]
                per_frame = model.config.hop_length
                short = model.decode(codes[..., : SHORT_SAMPLES // per_frame]).audio_values[0, 0]
            model.save_pretrained(saved)
            out[f"{size}_digest"] = np.array(info["state_digest"])
            out[f"{size}_saved_digest"] = np.array(state_digest(read_safetensors(Path(saved))))
            out[f"{size}_saved_config"] = np.array((Path(saved) / "config.json").read_text())
            out[f"{size}_attn"] = np.array(str(model.semantic_model.config._attn_implementation))
            out[f"{size}_codes"] = codes[0].numpy().astype(np.int16)
            out[f"{size}_audio_head"] = audio[:1000].numpy()
            out[f"{size}_audio_strided"] = audio[::STRIDE].numpy()
            out[f"{size}_audio_len"] = np.array(audio.shape[0])
            out[f"{size}_short"] = short.numpy()
            print(size, "codes", tuple(codes.shape), "audio", tuple(audio.shape), "std", float(audio.std()),
                  "digest equal after save_pretrained:", out[f"{size}_digest"] == out[f"{size}_saved_digest"])
    np.savez_compressed(args.out, **out)
    print(f"{args.out}: {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
