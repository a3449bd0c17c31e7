"""Higgs Audio v2's reference voices: named clips with their transcripts, and the codec encoder that turns any
reference clip into codes once per content.

    model_kwargs.voices       {NAME: {"audio": WAV path, "text": transcript}} ("codes": a .npy [K, T] instead of
                              audio: codes made earlier)
    model_kwargs.voice_dir    a folder of NAME.wav + NAME.txt pairs (`omni serve --voice-dir` sets it)
    model_kwargs.audio_tokenizer_path   the codec (default: the checkpoint's `audio_tokenizer/` folder, or the
                              local folder its processor_config.json names)

A clip is encoded by the codec's encoder (HuBERT + DAC + RVQ) at 24 kHz the first time its content is seen; the
codes are kept by the clip's hash (an LRU of `encoder_cache_size` entries), so a voice used by every request is
encoded once, and so is a clip a client re-sends.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from omni.errors import RequestError
from omni.messages import MultiModalInput

from stages.common.encoder_cache import DEFAULT_ENTRIES, EncoderCache
from stages.common.mm_items import mm_hash

CODEC_RATE = 24000
MAX_REFERENCE_S = 60.0


class VoiceBook:
    def __init__(self, voices: dict[str, dict[str, Any]], codec_path: Path | None, device: Any, num_codebooks: int,
                 cache_size: int = DEFAULT_ENTRIES):
        self._voices = voices
        self.codec_path = codec_path
        self.device = device
        self.num_codebooks = num_codebooks
        self.cache = EncoderCache(cache_size)
        self._codec = None
        self._refs: dict[str, tuple[str, np.ndarray]] = {}

    @classmethod
    def from_kwargs(cls, model_path: Path, kwargs: dict[str, Any], device: Any, num_codebooks: int) -> "VoiceBook":
        voices: dict[str, dict[str, Any]] = {}
        voice_dir = kwargs.get("voice_dir")
        if voice_dir:
            folder = Path(voice_dir).expanduser()
            if not folder.is_dir():
                raise ValueError(f"voice_dir: {folder} is not a directory")
            for wav in sorted(folder.glob("*.wav")):
                txt = wav.with_suffix(".txt")
                if not txt.is_file():
                    raise ValueError(f"voice_dir: {wav.name} has no transcript {txt.name} beside it")
                voices[wav.stem] = {"audio": str(wav), "text": txt.read_text().strip()}
        for name, spec in dict(kwargs.get("voices") or {}).items():
            if not isinstance(spec, dict) or "text" not in spec or not ({"audio", "codes"} & set(spec)):
                raise ValueError(f"voices.{name}: give {{audio: WAV path, text: transcript}} (or codes: a .npy)")
            voices[str(name)] = dict(spec)
        from stages.higgs_audio_v2.codec_weights import codec_directory

        codec = kwargs.get("audio_tokenizer_path")
        return cls(voices, codec_directory(codec if codec else model_path), device, num_codebooks,
                   int(kwargs.get("encoder_cache_size", DEFAULT_ENTRIES)))

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._voices))

    def stats(self) -> dict[str, int]:
        return self.cache.stats()

    def codec(self):
        if self._codec is None:
            if self.codec_path is None:
                raise RequestError("multi_modal_data: this higgs_audio_v2 checkpoint has no audio tokenizer to "
                                   "encode a reference clip (model_kwargs.audio_tokenizer_path)",
                                   field="multi_modal_data")
            from stages.higgs_audio_v2.codec_model import HiggsCodec

            self._codec = HiggsCodec.from_pretrained(self.codec_path, device=self.device)
        return self._codec

    def reference(self, name: str) -> tuple[str, np.ndarray]:
        """A named voice's transcript and codes [K, T] (the name matched case-insensitively, as omni serve
        matches voices)."""
        name = next((v for v in self._voices if v.lower() == str(name).lower()), name)
        if name not in self._voices:
            known = ", ".join(self.names()) or "none are configured"
            raise RequestError(f"voice: unknown voice {name!r}; known: {known}", field="voice", code="invalid_voice")
        if name not in self._refs:
            spec = self._voices[name]
            if "codes" in spec:
                codes = self._check_codes(np.load(spec["codes"]), f"voices.{name}.codes")
            else:
                import soundfile as sf

                wave, rate = sf.read(spec["audio"], dtype="float32", always_2d=True)
                codes = self.encode(MultiModalInput("audio", wave.mean(axis=1), rate), f"voices.{name}.audio")
            self._refs[name] = (str(spec["text"]), codes)
        return self._refs[name]

    def _check_codes(self, codes: np.ndarray, where: str) -> np.ndarray:
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[0] != self.num_codebooks or not np.issubdtype(codes.dtype, np.integer):
            raise ValueError(f"{where}: codes must be integers [{self.num_codebooks}, T], got {codes.dtype} "
                             f"{codes.shape}")
        return codes.astype(np.int64)

    def encode(self, item: MultiModalInput, where: str) -> np.ndarray:
        """A reference clip's codes [K, T] (encoded once per content)."""
        wave = np.asarray(item.data, dtype=np.float32)
        if wave.ndim != 1 or wave.size == 0 or not np.isfinite(wave).all():
            raise RequestError(f"{where}: a reference clip is a non-empty mono waveform of finite samples "
                               f"(got shape {wave.shape})", field=where)
        rate = int(item.sampling_rate or CODEC_RATE)
        if wave.size / rate > MAX_REFERENCE_S:
            raise RequestError(f"{where}: a reference clip of {wave.size / rate:.1f} s; at most {MAX_REFERENCE_S:g} s",
                               field=where)
        key = mm_hash(MultiModalInput("audio", wave, rate))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        codes = self._encode(wave, rate)
        self.cache.put(key, codes)
        return codes

    def _encode(self, wave: np.ndarray, rate: int) -> np.ndarray:
        """The codec's encoder on the clip at its rate (resampled as transformers' processor expects it: the
        codec's own rate)."""
        import torch

        from stages.common.resample import resample

        codec = self.codec()
        x = torch.from_numpy(np.ascontiguousarray(wave))
        if rate != codec.sample_rate:
            x = resample(x, rate, codec.sample_rate)
        with torch.inference_mode():
            codes = codec.encode(x.to(self.device)[None, None])
        return codes[0].cpu().numpy().astype(np.int64)
