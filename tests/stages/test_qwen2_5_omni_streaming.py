"""Qwen2.5-Omni streamed end to end: thinker ~> talker (one thinker row per talker step) ~> token2wav
(codec chunks in, waveform chunks out), on the tiny random checkpoint, against the same pipeline
without streaming edges."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni import Omni, StageDelta
from omni.engine.in_flight import InFlight, StreamWork
from omni.messages import StageInput
from tests.tolerances import SUMS_PER_DECODER_LAYER, reorder_atol

CONFIG = str(Path(__file__).resolve().parents[2] / "stage_configs" / "qwen2_5_omni_tiny.yaml")
STREAMED = {
    "talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
    "token2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 4}],
                  "model_kwargs": {"first_chunk_codes": 5, "chunk_codes": 8}},
}
PROMPTS = ["Hello there, tell me about the sea.", "What is the capital of France?"]
# Chunked vs one-shot waveform: windows with one DiT block of context on each side compute the same
# math on other shapes, so only the blocking of fp32 sums differs (measured: 139 dB SNR). The chain:
# 36 DiT evaluations (10 Runge-Kutta steps) of 2 layers (SUMS_PER_DECODER_LAYER each, plus the input
# and output projections), then BigVGAN's ~16 convolutions; the longest sum is a 32-channel, kernel-8
# convolution (256 terms). WAVE_REL bounds |diff| relative to the waveform's largest sample, so the
# SNR is at least -20 log10(WAVE_REL), ~33 dB: still above a window without look-ahead (19 dB) or
# without left context (24 dB), the bugs this comparison is there to catch.
WAVE_REL = reorder_atol(256, 1.0, depth=36 * (2 * SUMS_PER_DECODER_LAYER + 2) + 16)
MIN_SNR_DB = -20 * float(np.log10(WAVE_REL))


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(((ref - got) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref**2).sum()) / noise)


def stream_all(o: Omni, prompts, **kw):
    finals, audio, deltas = {}, {}, {}
    for ev in o.stream(prompts, **kw):
        if isinstance(ev, StageDelta):
            deltas.setdefault((ev.request_id, ev.stage), []).append(ev)
            if ev.audio is not None:
                audio.setdefault(ev.request_id, []).append(ev.audio)
        else:
            finals[(ev.request_id, ev.stage)] = ev
    return finals, audio, deltas


def assert_clean(o: Omni) -> None:
    for name, worker in o._backend.workers.items():
        engine = worker.engine
        if hasattr(engine, "kv"):
            engine.kv.check_integrity()
            assert engine.kv.num_free_blocks == engine.kv.num_blocks, f"stage {name} leaked blocks"
            assert not engine.scheduler.requests, name
        else:
            assert not engine._streams and not engine._queue, name
        assert not worker._incoming and not worker._in_flight, name


@pytest.fixture(scope="module")
def one_shot():
    with Omni(CONFIG, backend="local") as o:
        return o.generate(PROMPTS, use_tqdm=False)


@pytest.mark.slow
def test_streamed_pipeline_matches_the_one_shot_pipeline(one_shot):
    with Omni(CONFIG, backend="local", stage_overrides=STREAMED) as o:
        finals, audio, deltas = stream_all(o, PROMPTS)
        for ref in one_shot:
            rid = ref.request_id
            assert finals[(rid, "thinker")].token_ids == ref.outputs["thinker"].token_ids
            wav, ref_wav = finals[(rid, "token2wav")].audio, ref.outputs["token2wav"].audio
            assert finals[(rid, "token2wav")].error is None
            assert len(audio[rid]) >= 3, "the waveform did not come in chunks"
            # The chunks are the final waveform, exactly, in order.
            np.testing.assert_array_equal(np.concatenate(audio[rid]), wav)
            assert wav.shape == ref_wav.shape
            assert snr_db(ref_wav, wav) >= MIN_SNR_DB
            assert np.abs(ref_wav - wav).max() <= WAVE_REL * np.abs(ref_wav).max()
            thinker_text = "".join(d.text for d in deltas[(rid, "thinker")])
            assert thinker_text == finals[(rid, "thinker")].text
        assert_clean(o)


@pytest.mark.slow
def test_streaming_caching_on_off_identical_and_turn_two_hits():
    turns = ["Hello there, tell me about the sea.",
             [{"role": "user", "content": "Hello there, tell me about the sea."},
              {"role": "assistant", "content": "The sea is vast."},
              {"role": "user", "content": "And the sky?"}]]
    results = {}
    for caching in (True, False):
        ov = {**STREAMED, "thinker": {"enable_prefix_caching": caching},
              "talker": {**STREAMED["talker"], "enable_prefix_caching": caching}}
        with Omni(CONFIG, backend="local", stage_overrides=ov) as o:
            outs = []
            for turn in turns:
                finals, _, _ = stream_all(o, [{"prompt": turn}])
                outs.append({k[1]: v for k, v in finals.items()})
            results[caching] = outs
            if caching:
                stats = o.stats()["stages"]
                assert stats["thinker"]["prefix_cache_hits"] > 0 and stats["talker"]["prefix_cache_hits"] > 0
            assert_clean(o)
    for on, off in zip(results[True], results[False]):
        assert on["thinker"].token_ids == off["thinker"].token_ids
        # The talker's codes follow greedily from equal thinker tokens; token2wav gets them in the
        # same chunks with the same seed either way, so its waveform is bitwise the same.
        np.testing.assert_array_equal(on["token2wav"].audio, off["token2wav"].audio)
    assert results[True][1]["thinker"].num_cached_tokens > 0


@pytest.mark.slow
def test_abort_mid_audio_releases_all_three_stages():
    with Omni(CONFIG, backend="local", stage_overrides=STREAMED) as o:
        it = o.stream(["Tell me everything about the sea."])
        for ev in it:
            if isinstance(ev, StageDelta) and ev.audio is not None and len(ev.audio):
                break  # the first audio chunk: hang up
        it.close()
        for _ in range(10):
            o._orch.step(0.01)
        assert_clean(o)
        [after] = o.generate(["Still there?"], use_tqdm=False)
        assert after.error is None and after.outputs["token2wav"].audio.size
        assert_clean(o)


@pytest.mark.slow
def test_a_lost_codec_chunk_fails_naming_the_edge():
    from omni.config.loader import load_config

    cfg = load_config(CONFIG, STREAMED)
    cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"stream_chunk_timeout_s": 1.0})})
    with Omni(cfg, backend="local") as o:
        o._backend.workers["token2wav"].push_chunk = lambda *a: None
        [out] = o.generate(["Hello"], use_tqdm=False)
        # The message names the chunk timeout (not runtime.request_timeout_s, 300 s here): which one
        # fired is asserted, not how fast this machine got there.
        assert "streaming edge talker -> token2wav did not arrive within 1s" in out.error.message, out.error


@pytest.mark.slow
def test_token2wav_flushes_the_last_chunk_exactly_once(tmp_path):
    """Codes that end between chunks, and an end announced after the last full chunk went out."""
    import torch

    from stages.checkpoints.builtin import builtin_path
    from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

    model = Qwen2_5OmniToken2WavStage.load(builtin_path("tiny-qwen2_5-omni"), dtype=torch.float32,
                                           device=torch.device("cpu"),
                                           model_kwargs={"first_chunk_codes": 4, "chunk_codes": 6})
    codes = [int(c) for c in np.random.default_rng(1).integers(0, 8000, 22)]
    ref = model.generate(codes, None, 0)
    flight = InFlight(model)  # the one-shot engine's stepping of the windows
    for tail_alone in (False, True):
        st = model.prepare_stream(StageInput("r", prompt_token_ids=codes[:3], input_complete=False), 0)
        work = StreamWork(st)
        pieces, dones = [], 0
        feed = [codes[3:10], codes[10:22]] + ([[]] if tail_alone else [])
        for i, part in enumerate(feed):
            model.extend_stream(st, StageInput("r", prompt_token_ids=part), last=i == len(feed) - 1)
            while flight.ready(work):
                (result,) = flight.step([work], None)  # None while its window is in flight
                if result is not None:
                    pieces.append(result[0]["audio"])
                    dones += result[1]
        assert dones == 1 and not flight.ready(work)
        wav = np.concatenate(pieces)
        np.testing.assert_array_equal(wav, flight.result(work)["audio"])
        assert wav.shape == ref.shape and snr_db(ref, wav) >= MIN_SNR_DB
    with pytest.raises(ValueError, match="complete"):
        model.extend_stream(st, StageInput("r", prompt_token_ids=[1]), last=True)


# 62 codes: 3 + 4 + 8 + 16 + 16, then the 15 left go on their own; 52: after 3 + 4 + 8 + 16 + 16, the 5 left
# go on their own too (the common schedule, stages/common/audio_chunks.py: code2wav cuts as transformers'
# chunked_decode does, and so does token2wav).
@pytest.mark.parametrize("length,sizes", [(62, [3, 4, 8, 16, 16, 15]), (52, [3, 4, 8, 16, 16, 5])])
@pytest.mark.slow
def test_token2wav_chunks_grow_to_max_chunk_codes(length, sizes):
    """After the first chunk, chunks start at chunk_codes and double up to max_chunk_codes; a short tail
    is a chunk of its own; the pieces still make the one-shot waveform."""
    import torch

    from stages.checkpoints.builtin import builtin_path
    from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

    path = builtin_path("tiny-qwen2_5-omni")
    cpu = torch.device("cpu")
    model = Qwen2_5OmniToken2WavStage.load(path, dtype=torch.float32, device=cpu, model_kwargs={
        "first_chunk_codes": 3, "chunk_codes": 4, "max_chunk_codes": 16})
    assert [model.chunk_size(i) for i in range(6)] == [3, 4, 8, 16, 16, 16]
    codes = [int(c) for c in np.random.default_rng(2).integers(0, 8000, length)]
    st = model.prepare_stream(StageInput("r", prompt_token_ids=codes, input_complete=True), 0)
    model.extend_stream(st, StageInput("r", prompt_token_ids=[]), last=True)
    flight, work = InFlight(model), StreamWork(st)  # the one-shot engine's stepping of the windows
    got, pieces, finished = [], [], False
    while flight.ready(work):
        before = st.done
        (result,) = flight.step([work], None)
        if result is not None:  # a window takes several calls: one Runge-Kutta step each
            got.append(st.done - before)
            pieces.append(result[0]["audio"])
            finished = result[1]
    assert got == sizes and finished
    wav = np.concatenate(pieces)
    ref = model.generate(codes, None, 0)
    assert wav.shape == ref.shape and snr_db(ref, wav) >= MIN_SNR_DB
    with pytest.raises(ValueError, match="max_chunk_codes: must be >= chunk_codes"):
        Qwen2_5OmniToken2WavStage.load(path, dtype=torch.float32, device=cpu,
                                       model_kwargs={"chunk_codes": 8, "max_chunk_codes": 4})


@pytest.mark.slow
def test_a_stream_whose_upstream_finished_first_still_streams_the_same_audio():
    """On Ray the talker may finish before token2wav looks at its chunks, which then arrive as one finished
    piece: token2wav must still cut the reply into its windows and stream them (it ran the reply in one shot
    instead: no audio deltas, and a waveform whose last bits followed the actors' timing). Here token2wav
    gets every chunk only once the talker has sent its last."""
    with Omni(CONFIG, backend="local", stage_overrides=STREAMED) as o:
        want_finals, want_audio, _ = stream_all(o, PROMPTS)
        wav2 = o._backend.workers["token2wav"]
        held_chunks: list = []
        real_push = wav2.push_chunk

        def push(rid, seq, chunk):
            held_chunks.append((rid, seq, chunk))
            if chunk.finished:
                for args in [h for h in held_chunks if h[0] == rid]:
                    real_push(*args)

        wav2.push_chunk = push
        finals, audio, _ = stream_all(o, PROMPTS)
        del wav2.push_chunk
        ids = lambda fs: sorted({rid for rid, _ in fs}, key=int)  # noqa: E731 - the two runs' ids, prompt order
        assert len(ids(finals)) == len(PROMPTS)
        for want, rid in zip(ids(want_finals), ids(finals)):
            assert len(audio[rid]) >= 3 and len(audio[rid]) == len(want_audio[want])
            np.testing.assert_array_equal(np.concatenate(audio[rid]), finals[(rid, "token2wav")].audio)
            np.testing.assert_array_equal(finals[(rid, "token2wav")].audio, want_finals[(want, "token2wav")].audio)
        assert_clean(o)


@pytest.mark.ray
@pytest.mark.slow
def test_streamed_audio_on_ray_actor_to_actor(one_shot, ray_cluster):
    """Three stage actors (on the session's shared cluster): thinker rows reach the talker and codec chunks
    reach token2wav actor to actor."""
    with Omni(CONFIG, stage_overrides=STREAMED) as o:
        finals, audio, _ = stream_all(o, PROMPTS)
        for ref in one_shot:
            rid = ref.request_id
            assert finals[(rid, "thinker")].token_ids == ref.outputs["thinker"].token_ids
            wav = finals[(rid, "token2wav")].audio
            np.testing.assert_array_equal(np.concatenate(audio[rid]), wav)
            assert snr_db(ref.outputs["token2wav"].audio, wav) >= MIN_SNR_DB
        stats = o.stats()["stages"]
        assert stats["thinker"]["kv_usage"] == 0.0 and stats["talker"]["kv_usage"] == 0.0
