"""The Higgs Audio v2 codec as a one-shot stage (OneShotStageEngine): one-shot and streamed decode, batching,
typed errors. The codec itself is checked against transformers in test_codec_model.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
from omni.errors import RequestError
from omni.messages import EdgePayload, StageInput
from stages.higgs_audio_v2.codec import HiggsAudioV2CodecStage
from stages.higgs_audio_v2.codec_checkpoint import higgs_codec_checkpoint
from stages.higgs_audio_v2.payloads import CodesToWave

# Streamed vs one-shot with the default contexts (the decoder's reach on both sides): 110 dB (tiny) and 103 dB
# (tiny8) measured, the rounding of convolutions over windows of other lengths; without right context 16 / 13 dB.
STREAM_SNR_DB = 60
# Batched vs alone, as a fraction of the reference's peak: the convolutions block a batch's sums otherwise (6e-5
# seen); a wrong or shifted frame moves samples by a good fraction of the peak.
BATCH_RTOL_OF_PEAK = 2e-4


@pytest.fixture(scope="module")
def codec_stage(higgs_codec):
    return HiggsAudioV2CodecStage(higgs_codec("tiny"), torch.device("cpu"))


def _frames(higgs_ref, n: int, size: str = "tiny") -> np.ndarray:
    return higgs_ref[f"{size}_codes"].astype(np.int64).T[:n].copy()  # [T, K]: as the LLM's processor hands them


def _engine(stage, **kw):
    return OneShotStageEngine(OneShotEngineConfig("codec", type(stage), None, **kw), model=stage)


def _drain(engine, limit=1000):
    deltas, outs = [], {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return deltas, outs
        step = engine.step()
        deltas += [(d.request_id, d.audio) for d in step.deltas]
        outs.update({o.request_id: o for o in step.finished + step.aborted})
    raise AssertionError("the engine never finished")


def _snr_db(got: np.ndarray, ref: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((got - ref) ** 2.0), 1e-30)))


def _close_to_peak(got, ref, rtol_of_peak):
    np.testing.assert_allclose(got, ref, rtol=0, atol=rtol_of_peak * float(np.abs(ref).max()))


def test_one_shot_requests_decode_all_frames_and_batch_by_length(codec_stage, higgs_ref):
    """A step's requests of one length decode as one batch (the engine's batched hook), equal to each alone and
    to the codec's decode (transformers' waveform: test_codec_model)."""
    engine = _engine(codec_stage, max_num_seqs=4)
    frames = {"a": _frames(higgs_ref, 20), "b": _frames(higgs_ref, 20)[::-1].copy(), "c": _frames(higgs_ref, 13)}
    for rid, f in frames.items():
        engine.add_request(StageInput(rid, prompt_token_ids=f[:, 0].tolist(), payload=CodesToWave(f)))
    engine.add_request(StageInput("none", prompt_token_ids=[]))  # no frames (the LLM's eos came first): no audio
    _, outs = _drain(engine)
    assert engine.stats().as_dict()["batch_calls"] == 1
    assert outs["none"].error is None and len(outs["none"].audio) == 0
    for rid, f in frames.items():
        out = outs[rid]
        assert out.error is None and out.passthrough["sampling_rate"] == 24000 and out.audio.dtype == np.float32
        alone = codec_stage.codec.decode(torch.from_numpy(f.T.copy())[None])[0, 0].numpy()
        assert out.audio.shape == (len(f) * codec_stage.hop_length,)
        _close_to_peak(out.audio, alone, BATCH_RTOL_OF_PEAK)


def test_a_batch_decodes_at_most_max_batch_tokens_frames_a_call(codec_stage, higgs_ref, monkeypatch):
    calls = []
    decode = codec_stage.codec.decode
    monkeypatch.setattr(codec_stage.codec, "decode", lambda codes: calls.append(codes.shape[0]) or decode(codes))
    jobs = [_frames(higgs_ref, 20), _frames(higgs_ref, 20), _frames(higgs_ref, 20), _frames(higgs_ref, 9),
            _frames(higgs_ref, 0)]
    outs = codec_stage.run_generation_batch(jobs, 45)
    assert calls == [2, 1, 1]  # 20-frame windows two at a time (40 <= 45), the 9-frame one alone
    assert [len(o["audio"]) // 480 for o in outs] == [20, 20, 20, 9, 0]


@pytest.mark.parametrize("codes,match,limit,actual", [
    (np.full((3, 4), 64), r"code 64 is out of range \(0..63\)", 64, 64),
    (np.full((3, 4), -1), r"code -1 is out of range", 64, -1),
    (np.zeros((3, 3), np.int64), r"expected \[frames, 4\] codec frames, got shape \[3, 3\]", 4, 3),
    (np.zeros(5, np.int64), r"got shape \[5\]", 4, 5),
    (np.full((2, 4), 1.5), "must be integers", None, None),
    (np.zeros((51, 4), np.int64), "51 frames, at most 50 allowed", 50, 51),
])
def test_bad_codes_are_request_errors_naming_the_field_and_numbers(codec_stage, codes, match, limit, actual):
    stage = HiggsAudioV2CodecStage(codec_stage.codec, torch.device("cpu"), max_frames=50)
    engine = _engine(stage)
    with pytest.raises(RequestError, match=match) as err:
        engine.add_request(StageInput("x", payload=CodesToWave(codes)))
    assert err.value.field == "payload.codes" and (err.value.limit, err.value.actual) == (limit, actual)
    engine.add_request(StageInput("s", payload=CodesToWave(np.zeros((40, 4), np.int64)), input_complete=False))
    with pytest.raises(RequestError, match=match) as err:  # a later chunk of a stream: 40 + 11 frames at most
        engine.extend_request("s", [], payload=CodesToWave(codes[:11]))
    assert err.value.field == "payload.codes" and (err.value.limit, err.value.actual) == (limit, actual)
    engine.abort("s")
    _drain(engine)
    assert not engine.has_unfinished()


@dataclass(slots=True)
class _OtherPayload(EdgePayload):
    codes: np.ndarray


def test_a_payload_of_another_kind_is_refused(codec_stage):
    with pytest.raises(RequestError, match="expected a CodesToWave") as err:
        _engine(codec_stage).add_request(StageInput("x", payload=_OtherPayload(np.zeros((2, 4), np.int64))))
    assert err.value.field == "payload"


def _stream(stage, frames_by_rid: dict[str, np.ndarray], piece: int, **engine_kw):
    """Frames fed `piece` at a time (an engine step after each), every stream alike: (deltas in order, outputs,
    frames given when each stream's first audio came, engine)."""
    engine = _engine(stage, **engine_kw)
    first_at: dict[str, int] = {}
    deltas, outs = [], {}
    total = max(len(f) for f in frames_by_rid.values())
    for given in range(piece, total + piece, piece):
        for rid, f in frames_by_rid.items():
            chunk, last = f[given - piece : given], given >= len(f)
            if given == piece:
                engine.add_request(StageInput(rid, payload=CodesToWave(chunk), input_complete=False))
                if last:
                    engine.extend_request(rid, [], last=True)
            elif given - piece < len(f):
                engine.extend_request(rid, [], last=last, payload=CodesToWave(chunk))
        step = engine.step()
        for d in step.deltas:
            first_at.setdefault(d.request_id, given)
        deltas += [(d.request_id, d.audio) for d in step.deltas]
        outs.update({o.request_id: o for o in step.finished})
    more, rest = _drain(engine)
    return deltas + more, {**outs, **rest}, first_at, engine


@pytest.mark.slow
def test_streamed_windows_join_to_the_one_shot_waveform(codec_stage, higgs_ref):
    """Frames arrive 5 at a time; windows of 8, 25, 50, 67 frames decode as soon as their frames and the right
    context exist; the pieces join to the one-shot length, within STREAM_SNR_DB of it."""
    frames = _frames(higgs_ref, 150)
    one_shot = codec_stage.run_generation(frames)["audio"]
    deltas, outs, first_at, _ = _stream(codec_stage, {"a": frames}, piece=5)
    joined = np.concatenate([a for _, a in deltas])
    assert len(joined) == len(one_shot) == 150 * 480
    np.testing.assert_array_equal(outs["a"].audio, joined)
    assert _snr_db(joined, one_shot) >= STREAM_SNR_DB
    reach = codec_stage.codec.decoder_reach_frames()
    assert codec_stage.right_context_frames == reach == 15
    assert first_at["a"] == 25  # the first 8 frames and 15 of right context: the 5th piece, long before the end
    assert [len(a) // 480 for _, a in deltas] == [8, 25, 50, 67]


@pytest.mark.slow
def test_without_right_context_the_streamed_waveform_is_far_off(codec_stage, higgs_ref):
    """Why the right context is held back: the decoder is not causal."""
    frames = _frames(higgs_ref, 90)
    one_shot = codec_stage.run_generation(frames)["audio"]
    stage = HiggsAudioV2CodecStage(codec_stage.codec, torch.device("cpu"), right_context_frames=0)
    deltas, _, first_at, _ = _stream(stage, {"a": frames}, piece=5)
    joined = np.concatenate([a for _, a in deltas])
    assert len(joined) == len(one_shot) and first_at["a"] == 10
    assert _snr_db(joined, one_shot) < 30


def test_a_short_first_right_context_brings_the_first_audio_sooner_and_costs_only_that_window(codec_stage,
                                                                                             higgs_ref):
    """first_right_context_frames: the first window waits for fewer frames after it; the later windows keep the
    decoder's reach, so only the first window's samples move away from the one-shot waveform."""
    frames = _frames(higgs_ref, 90)
    one_shot = codec_stage.run_generation(frames)["audio"]
    stage = HiggsAudioV2CodecStage(codec_stage.codec, torch.device("cpu"), first_chunk_frames=2,
                                   first_right_context_frames=2)
    deltas, _, first_at, _ = _stream(stage, {"a": frames}, piece=1)
    joined = np.concatenate([a for _, a in deltas])
    assert first_at["a"] == 4 and len(deltas[0][1]) == 2 * 480  # 2 frames + 2 of right context
    assert len(joined) == len(one_shot)
    head = 2 * 480
    assert _snr_db(joined[head:], one_shot[head:]) >= STREAM_SNR_DB
    assert _snr_db(joined[:head], one_shot[:head]) < STREAM_SNR_DB  # the price, on the first window alone


@pytest.mark.slow
def test_windows_of_several_streams_decode_in_one_batch(codec_stage, higgs_ref):
    """Two streams fed alike have windows of one length in flight together: one decode for both, each piece
    the one it gets alone (to the batch's rounding); a stream of another length decodes its windows alone."""
    frames = _frames(higgs_ref, 60)
    alone, _, _, _ = _stream(codec_stage, {"a": frames}, piece=10)
    deltas, outs, _, engine = _stream(codec_stage, {"a": frames, "b": frames[::-1].copy(), "c": frames[:37]},
                                      piece=10)
    assert engine.stats().as_dict()["batch_calls"] >= 2
    got_a = [a for rid, a in deltas if rid == "a"]
    assert [len(a) for a in got_a] == [len(a) for _, a in alone]
    for got, ref in zip(got_a, [a for _, a in alone]):
        _close_to_peak(got, ref, BATCH_RTOL_OF_PEAK)
    for rid, n in (("b", 60), ("c", 37)):
        assert outs[rid].error is None and len(outs[rid].audio) == n * 480


def test_the_stage_loads_a_whole_higgs_directory_with_its_codec_in_audio_tokenizer(tmp_path):
    (tmp_path / "audio_tokenizer").symlink_to(higgs_codec_checkpoint("tiny8"), target_is_directory=True)
    stage = HiggsAudioV2CodecStage.load(tmp_path, dtype=torch.bfloat16, device=torch.device("cpu"),
                                        model_kwargs={"chunk_frames": 10, "left_context_frames": 4})
    assert (stage.num_codebooks, stage.codebook_size, stage.hop_length) == (8, 128, 960)
    assert stage.dtype == torch.float32 and next(stage.codec.parameters()).dtype == torch.float32
    assert stage.left_context_frames == 4 and stage.right_context_frames == stage.codec.decoder_reach_frames()
    with pytest.raises(ValueError, match="model_kwargs.right_context_frames: must be >= 0, got -1"):
        HiggsAudioV2CodecStage(stage.codec, torch.device("cpu"), right_context_frames=-1)
