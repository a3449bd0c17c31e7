"""Our torchaudio-free Higgs Audio v2 codec against transformers' `HiggsAudioV2TokenizerModel`, whose outputs on the
same random checkpoints and on real recorded speech are in tests/data/higgs_codec_reference.npz (written in
transformers' own environment: tests/data/README.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stages.common.resample import resample, resampled_length
from stages.higgs_audio_v2.codec_checkpoint import higgs_codec_checkpoint, state_digest
from stages.higgs_audio_v2.codec_model import HiggsCodec
from stages.higgs_audio_v2.codec_weights import read_safetensors

SIZES = ["tiny", "tiny8"]
# Waveforms, as a fraction of the reference's peak: with one thread both environments gave the same bits, with
# two the convolutions block their sums otherwise (2e-5 of the peak seen); a wrong or shifted frame moves samples
# by a good fraction of the peak.
DECODE_RTOL_OF_PEAK = 1e-4


def _assert_waves_close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=0, atol=DECODE_RTOL_OF_PEAK * float(np.abs(ref).max()))
# Our resampler runs torchaudio's operations in the same order: equal up to the convolution's blocking.
RESAMPLE_ATOL = 1e-6


def _speech_24k(ref) -> torch.Tensor:
    clip = torch.from_numpy(ref["clip_pcm16"].astype(np.float32) / 32768.0)
    return resample(clip, 16000, 24000)


@pytest.mark.parametrize("size", SIZES)
def test_the_recipe_writes_the_weights_transformers_was_given(size, higgs_ref):
    """Bit-identical checkpoints in both environments, and transformers' save_pretrained writes back the same
    keys and tensors (so a directory it saves holds exactly our module's keys)."""
    state = read_safetensors(higgs_codec_checkpoint(size))
    assert state_digest(state) == str(higgs_ref[f"{size}_digest"])
    assert str(higgs_ref[f"{size}_saved_digest"]) == str(higgs_ref[f"{size}_digest"])


def test_resampler_equals_torchaudio(higgs_ref):
    up = resample(torch.from_numpy(higgs_ref["resample_up_in"]), 16000, 24000).numpy()
    down = resample(torch.from_numpy(higgs_ref["resample_down_in"]), 24000, 16000).numpy()
    np.testing.assert_allclose(up, higgs_ref["resample_up_out"], rtol=0, atol=RESAMPLE_ATOL)
    np.testing.assert_allclose(down, higgs_ref["resample_down_out"], rtol=0, atol=RESAMPLE_ATOL)
    wave = _speech_24k(higgs_ref).numpy()
    assert len(wave) == resampled_length(len(higgs_ref["clip_pcm16"]), 16000, 24000) == 72000
    np.testing.assert_allclose(wave[:6000], higgs_ref["wave24_head"], rtol=0, atol=RESAMPLE_ATOL)
    np.testing.assert_allclose(wave[::50], higgs_ref["wave24_every50"], rtol=0, atol=RESAMPLE_ATOL)
    batch = torch.stack([torch.from_numpy(higgs_ref["resample_down_in"])] * 2)[:, None]  # [..., time] shapes
    assert resample(batch, 24000, 16000).shape == (2, 1, 4000)
    assert resampled_length(1001, 24000, 16000) == 668  # ceil(667.33)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_encode_equals_transformers(size, higgs_ref, higgs_codec):
    """Real speech -> codes: every codebook of every frame, exactly (the HuBERT branch on our resampler, the
    160-sample padding, the acoustic padding rule, the residual quantizer at the highest bandwidth)."""
    codes = higgs_codec(size).encode(_speech_24k(higgs_ref)[None, None])
    ref = higgs_ref[f"{size}_codes"].astype(np.int64)
    assert codes.shape == (1, *ref.shape) and codes.dtype == torch.int64
    np.testing.assert_array_equal(codes[0].numpy(), ref)
    assert len(np.unique(ref[0])) > 5  # the speech is coded, not one code repeated


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_decode_equals_transformers(size, higgs_ref, higgs_codec):
    codec = higgs_codec(size)
    codes = torch.from_numpy(higgs_ref[f"{size}_codes"].astype(np.int64))[None]
    audio = codec.decode(codes)[0, 0].numpy()
    assert audio.shape == (int(higgs_ref[f"{size}_audio_len"]),) == (codes.shape[2] * codec.hop_length,)
    _assert_waves_close(audio[:1000], higgs_ref[f"{size}_audio_head"])
    _assert_waves_close(audio[::16], higgs_ref[f"{size}_audio_strided"])
    short = higgs_ref[f"{size}_short"]
    got = codec.decode(codes[..., : len(short) // codec.hop_length])[0, 0].numpy()
    _assert_waves_close(got, short)
    assert 0.01 < float(np.abs(short).max()) < 10  # a waveform of a sane scale


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_decode_window_with_the_decoders_reach_is_the_whole_decode(size, higgs_ref, higgs_codec):
    codec = higgs_codec(size)
    codes = torch.from_numpy(higgs_ref[f"{size}_codes"].astype(np.int64))[None, :, :40]
    whole = codec.decode(codes)[0, 0].numpy()
    reach, hop = codec.decoder_reach_frames(), codec.hop_length
    for start, end in ((0, 7), (12, 20), (33, 40)):
        got = codec.decode_window(codes, start, end, reach, reach)[0, 0].numpy()
        _assert_waves_close(got, whole[start * hop : end * hop])


def _write(directory, state, config_json):
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(config_json)
    return directory


def test_a_directory_saved_by_transformers_loads_with_no_other_file(tmp_path, higgs_ref, higgs_codec):
    """config.json as transformers' save_pretrained wrote it, and its tensors (equal digest: the test above)."""
    state = read_safetensors(higgs_codec_checkpoint("tiny"))
    directory = _write(tmp_path / "saved", state, str(higgs_ref["tiny_saved_config"]))
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((directory / "config.json").read_text())["model_type"] == "higgs_audio_v2_tokenizer"
    model = HiggsCodec.from_pretrained(directory)
    assert state_digest(model.state_dict()) == str(higgs_ref["tiny_saved_digest"])
    assert model.num_quantizers == 4 and model.hop_length == 480 and model.codebook_size == 64


def _weight_norm_pair(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, v) with g * v / |v| == w, v a scaled copy (the norm over every dimension but `dim`)."""
    other = [d for d in range(w.dim()) if d != dim]
    return w.norm(dim=other, keepdim=True), 3.0 * w


def test_weight_norm_spellings_load_as_the_plain_weights(tmp_path, higgs_ref, higgs_codec):
    """The original codebase's weight_g / weight_v and torch's parametrization (DAC's apply_weight_norm) fold
    into our plain convolution weights; HuBERT's positional convolution keeps its parametrization."""
    state = dict(read_safetensors(higgs_codec_checkpoint("tiny")))
    plain = {k: v.clone() for k, v in state.items()}
    for key, names in (("acoustic_decoder.conv1", (".weight_g", ".weight_v")),
                       ("acoustic_decoder.block.0.conv_t1", (".parametrizations.weight.original0",
                                                             ".parametrizations.weight.original1")),
                       ("acoustic_encoder.block.1.res_unit2.conv1", (".weight_g", ".weight_v"))):
        g, v = _weight_norm_pair(state.pop(key + ".weight"), 0)
        state[key + names[0]], state[key + names[1]] = g, v
    pos = "semantic_model.encoder.pos_conv_embed.conv"
    state[pos + ".weight_g"] = state.pop(pos + ".parametrizations.weight.original0")
    state[pos + ".weight_v"] = state.pop(pos + ".parametrizations.weight.original1")
    state["semantic_model.masked_spec_embed"] = torch.zeros(16)  # in checkpoints of a HuBERT built with masking
    model = HiggsCodec.from_pretrained(_write(tmp_path / "wn", state, str(higgs_ref["tiny_saved_config"])))
    loaded = model.state_dict()
    for key, value in plain.items():
        torch.testing.assert_close(loaded[key], value, rtol=1e-6, atol=1e-7, msg=key)
    codes = torch.from_numpy(higgs_ref["tiny_codes"].astype(np.int64))[None, :, :12]
    _assert_waves_close(model.decode(codes)[0, 0].numpy(), higgs_codec("tiny").decode(codes)[0, 0].numpy())


def test_a_checkpoint_that_does_not_match_fails_naming_the_keys(tmp_path, higgs_ref):
    state = dict(read_safetensors(higgs_codec_checkpoint("tiny")))
    del state["fc2.bias"]
    state["fc3.weight"] = torch.zeros(1)
    directory = _write(tmp_path / "bad", state, str(higgs_ref["tiny_saved_config"]))
    with pytest.raises(ValueError, match=r"missing \['fc2.bias'\] \(1\), unexpected \['fc3.weight'\] \(1\)"):
        HiggsCodec.from_pretrained(directory)


def test_encode_refuses_a_waveform_that_is_not_mono(higgs_codec):
    with pytest.raises(ValueError, match="mono"):
        higgs_codec("tiny").encode(torch.zeros(1, 2, 4800))
