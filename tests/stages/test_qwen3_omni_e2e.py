"""Qwen3-Omni thinker -> talker -> code2wav vs transformers' Qwen3OmniMoeForConditionalGeneration.generate.

On both tiny random checkpoints (4 experts top-2 with 4 code groups; 2 experts top-1 with 2 code groups),
greedy: thinker tokens, every codebook of every codec frame and the waveform equal transformers', for
text and audio requests of different lengths batched together, with prefix caching on and off, and over three turns of
a conversation whose later turns hit both decoders' prefix caches."""
from __future__ import annotations

import numpy as np
import pytest

from omni.errors import RequestError
from omni.messages import StageInput
from stages.qwen3_omni.payloads import FramesToWave
from tests.stages.qwen3_omni_utils import (THINKER_LAYERS, VARIANTS, audio, cases, frames_of, hf_reference, image,
                                           make_chain, run_chain, stages)
from tests.tolerances import assert_rows_close, decoder_atol


def _check_against_transformers(variant, results, inputs):
    for inp in inputs:
        thinker_out, talker_out, wav_out = results[inp.request_id]
        ref_tokens, ref_frames, ref_wav = hf_reference(variant, inp)
        assert thinker_out.token_ids == ref_tokens, inp.request_id
        np.testing.assert_array_equal(frames_of(talker_out, inp), ref_frames, err_msg=inp.request_id)
        # The same frames through transformers' own code2wav.chunked_decode (same chunking): bitwise.
        assert wav_out.audio.dtype == np.float32
        np.testing.assert_array_equal(wav_out.audio, ref_wav, err_msg=inp.request_id)


# The k1g2 variant (its own transformers reference, ~20 s on 2 cores) in `make test` only; tiny covers the path.
@pytest.mark.parametrize("variant", [v if v == "tiny" else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_pipeline_matches_transformers_generate(variant, caching):
    inputs = cases()
    results = run_chain(make_chain(variant, caching=caching), inputs)
    _check_against_transformers(variant, results, inputs)
    frames = [frames_of(r[1], StageInput(rid)) for rid, r in results.items()]
    assert frames[0].shape[1] == {"tiny": 4, "k1g2": 2}[variant]
    assert len({f.tobytes() for f in frames}) == len(frames), "distinct prompts gave the same codes"
    assert all(np.abs(r[2].audio).max() > 1e-3 for r in results.values()), "a silent waveform proves little"


@pytest.mark.parametrize("modality", ["audio", "image"])
@pytest.mark.slow
def test_three_turn_conversation_hits_the_caches_and_matches_transformers(modality):
    """Each turn's prompt is the conversation so far (an audio clip or an image in turn 1): from turn 2 on the
    thinker and the talker (whose prompt holds every user turn) hit their prefix caches, and still equal
    transformers' generate; the thinker's per-token rows handed to the talker equal an uncached run's."""
    from omni.messages import MultiModalInput

    variant = "tiny"
    cached, uncached = make_chain(variant, caching=True), make_chain(variant, caching=False)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    # In turn 1, so in every later turn's prompt (an image: 3-D positions in both decoders, deepstack rows).
    clip = [MultiModalInput("audio", audio(1), 16000) if modality == "audio" else MultiModalInput("image", image(1))]
    user_turns = [[{"type": modality}, {"type": "text", "text": "Hello, what is this?"}],
                  "Tell me about the sea, and the ships that sail on it.", "And the stars?"]
    thinker = stages(variant)[0]
    before = thinker.stats()
    for turn, content in enumerate(user_turns):
        messages = messages + [{"role": "user", "content": content}]
        inp = StageInput(f"turn{turn}", prompt=messages, mm_inputs=clip)
        on = run_chain(cached, [inp])[inp.request_id]
        off = run_chain(uncached, [inp])[inp.request_id]
        _check_against_transformers(variant, {inp.request_id: on}, [inp])
        if turn:
            assert on[0].num_cached_tokens > 0 and on[1].num_cached_tokens > 0, turn
        # The embeddings are table rows, copied (bitwise); the accept layer's output is a decoder computed two ways.
        np.testing.assert_array_equal(on[0].mm_outputs["embeds"], off[0].mm_outputs["embeds"])
        ref = off[0].mm_outputs["accept_hidden"]
        assert_rows_close(on[0].mm_outputs["accept_hidden"], ref,
                          decoder_atol(ref, layers=THINKER_LAYERS, widest_sum=max(128, len(ref))), "accept_hidden")
        np.testing.assert_array_equal(on[2].audio, off[2].audio)
        messages = messages + [{"role": "assistant", "content": on[0].text}]
    after = thinker.stats()
    # The input is encoded at most once (the encoder cache is keyed by its content); the uncached chain re-reads it.
    assert after["encoder_runs"] - before["encoder_runs"] <= 1
    assert after["encoder_cache_hits"] > before["encoder_cache_hits"]


@pytest.mark.slow
def test_streamed_code2wav_equals_chunked_decode():
    """Frames arriving in pieces: the waveform chunks, concatenated, equal transformers' chunked_decode with the
    same chunking, bitwise. A smaller first chunk equals chunked_decode's loop on those windows; against the
    one-shot `forward` (no chunking) the difference is bounded by what the shorter left context changes."""
    import torch

    _, _, code2wav = stages("tiny")
    rng = np.random.default_rng(0)
    codes = rng.integers(0, code2wav.codebook_size, (40, code2wav.num_groups))
    model = code2wav.code2wav
    x = torch.from_numpy(codes.T.copy())[None]

    def stream(first: int, chunk: int, left: int, pieces: int = 7,
               max_chunk: int | None = None) -> tuple[np.ndarray, int]:
        c2w = type(code2wav)(model, code2wav.device, chunk_frames=chunk, first_chunk_frames=first,
                             left_context_frames=left, max_chunk_frames=max_chunk)
        parts = np.array_split(codes, pieces)
        state = c2w.prepare_stream(StageInput("s", payload=FramesToWave(parts[0])), 0)
        out, n = [], 0
        for i, part in enumerate(parts[1:] + [None]):
            while c2w.stream_ready(state):
                piece, _ = c2w.next_output(state)
                out.append(piece["audio"])
                n += 1
            if part is not None:
                c2w.extend_stream(state, StageInput("s", payload=FramesToWave(part)), last=i == len(parts) - 2)
        while c2w.stream_ready(state):
            out.append(c2w.next_output(state)[0]["audio"])
            n += 1
        whole = np.concatenate(out)
        np.testing.assert_array_equal(whole, c2w.stream_result(state)["audio"])
        return whole, n

    with torch.inference_mode():
        for chunk, left in ((8, 3), (12, 25)):
            got, n = stream(chunk, chunk, left)
            ref = model.chunked_decode(x, chunk_size=chunk, left_context_size=left).reshape(-1).numpy()
            assert n >= 3
            np.testing.assert_array_equal(got, ref)
        got, n = stream(4, 12, 25)  # a small first chunk for a short time to first audio
        spf = code2wav.samples_per_frame
        windows = [(0, 4), (4, 16), (16, 28), (28, 40)]
        ctx = [25 if s - 25 > 0 else s for s, _ in windows]  # chunked_decode's left context rule
        ref = np.concatenate([model(x[..., s - c : e])[..., c * spf :].reshape(-1).numpy()
                              for (s, e), c in zip(windows, ctx)])
        np.testing.assert_array_equal(got, ref)
        # vs the one-shot forward: each window loses a few trailing samples to the causal transposed convolutions
        # (chunked_decode's own behaviour), so each piece is compared with the one-shot samples of its frames. A
        # window sees 25 frames of left context, less than the transformer's 72-frame sliding window and the
        # convolutions' reach, so samples differ: the bound is the measured SNR, not rounding.
        one_shot = model(x).reshape(-1).numpy()
        pieces = np.split(got, np.cumsum([len(model(x[..., s - c : e])[..., c * spf :].reshape(-1))
                                          for (s, e), c in zip(windows, ctx)])[:-1])
        aligned = np.concatenate([one_shot[s * spf : s * spf + len(p)] for (s, _), p in zip(windows, pieces)])
        snr = 10 * np.log10(np.sum(aligned ** 2) / max(np.sum((aligned - got) ** 2), 1e-30))
        assert snr > 30, snr  # measured 44.6 dB on the tiny checkpoint; a misplaced window gives about 0 dB

        # Growing chunks (what a listener needs on a slow machine: each chunk made before the queued audio runs
        # out): 2 frames, then 3 doubling up to 10, so the windows are [0, 2), [2, 5), [5, 11), [11, 21), [21, 31),
        # [31, 40), each with chunked_decode's left context; the one-shot path decodes in windows of 10.
        got, n = stream(2, 3, 25, max_chunk=10)
        windows = [(0, 2), (2, 5), (5, 11), (11, 21), (21, 31), (31, 40)]
        ref = np.concatenate([model(x[..., s - (25 if s > 25 else s) : e])[..., (25 if s > 25 else s) * spf :]
                              .reshape(-1).numpy() for s, e in windows])
        assert n == len(windows)
        np.testing.assert_array_equal(got, ref)
        grown = type(code2wav)(model, code2wav.device, chunk_frames=3, first_chunk_frames=2, max_chunk_frames=10)
        assert [grown.chunk_size(i) for i in range(6)] == [2, 3, 6, 10, 10, 10]
        np.testing.assert_array_equal(grown.generate(codes),
                                      model.chunked_decode(x, chunk_size=10, left_context_size=25).reshape(-1).numpy())
        with pytest.raises(ValueError, match="max_chunk_frames: must be >= chunk_frames"):
            type(code2wav)(model, code2wav.device, chunk_frames=8, max_chunk_frames=4)


def test_refusals_name_the_field():
    thinker, talker, code2wav = stages("tiny")
    from omni.messages import MultiModalInput

    frames = np.zeros((4, 32, 32, 3), np.float32)
    with pytest.raises(RequestError) as e:
        thinker.preprocess(StageInput("r", prompt="hi", mm_inputs=[MultiModalInput("video", frames)]))
    assert e.value.field == "multi_modal_data.video[0]" and "uint8" in str(e.value)
    with pytest.raises(RequestError) as e:
        thinker.preprocess(StageInput("r", prompt=[{"role": "user", "content": [{"type": "video"}]}]))
    assert e.value.field == "prompt" and "more video placeholders than video mm_inputs (0)" in str(e.value)
    with pytest.raises(RequestError) as e:
        thinker.preprocess(StageInput("r", prompt=[{"role": "user", "content": [{"type": "hologram"}]}]))
    assert e.value.field == "prompt[0].content[0].type"
    with pytest.raises(RequestError) as e:
        talker.preprocess(StageInput("r"))
    assert e.value.field == "payload"
    t, k, w = make_chain("tiny")
    inp = StageInput("r", prompt="Hello")
    out = run_chain((t, k, w), [inp])["r"][0]
    from stages.qwen3_omni.edges import thinker2talker

    bad = thinker2talker({"thinker": out}, StageInput("r", extra={"speaker": "Nobody"}))
    with pytest.raises(RequestError) as e:
        talker.preprocess(bad)
    assert e.value.field == "speaker"
    with pytest.raises(RequestError) as e:
        code2wav.prepare_generation(StageInput("r", payload=FramesToWave(np.full((3, code2wav.num_groups), 10_000))), 0)
    assert e.value.field == "payload.codes"
    with pytest.raises(RequestError) as e:
        code2wav.prepare_generation(StageInput("r", payload=FramesToWave(np.zeros((3, 1), np.int64))), 0)
    assert e.value.field == "payload.codes"


@pytest.mark.slow
def test_streaming_edges_with_an_image_equal_one_shot():
    """Through Omni (local backend): both edges streaming, an image prompt (3-D positions, the grids reaching the
    talker as mm_meta rows in the first chunks) gives the non-streamed pipeline's text and waveform."""
    from pathlib import Path

    from omni import Omni
    from omni.config.loader import load_config

    config = Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_tiny.yaml"
    streaming = {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
                 "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}]}}
    prompts = [{"prompt": "What is in this picture?", "multi_modal_data": {"image": image(2)}}]
    results = []
    for overrides in (None, streaming):
        with Omni(load_config(config, overrides), backend="local") as omni:
            [r] = omni.generate(prompts, use_tqdm=False)
        assert r.error is None
        results.append(r.outputs)
    assert results[0]["thinker"].token_ids == results[1]["thinker"].token_ids
    np.testing.assert_array_equal(results[0]["code2wav"].audio, results[1]["code2wav"].audio)
