"""token2wav's vocoder thread (model_kwargs.vocoder_thread): BigVGAN of a stream's later windows runs on
a thread of its own while the DiT steps the windows in flight. The same ops on the same inputs, so the
waveforms are bitwise those of the inline stage; a stream's pieces leave in order, its first piece in the
step its ODE ends; a failure there fails that stream alone, and an abort drops its pieces."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from omni.engine.one_shot_engine import OneShotEngineConfig, OneShotStageEngine
from omni.outputs import StageInput


@pytest.fixture(scope="module")
def threaded(tiny_omni):
    from stages.qwen2_5_omni_token2wav import Qwen2_5OmniToken2WavStage

    stage = Qwen2_5OmniToken2WavStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"),
                                           model_kwargs={"vocoder_thread": True})
    yield stage
    stage.close()


def _engine(model, max_num_seqs=4):
    return OneShotStageEngine(OneShotEngineConfig("token2wav", type(model), None, max_num_seqs=max_num_seqs),
                              model=model)


def _add(engine, codes_by_rid):
    for rid, c in codes_by_rid.items():
        engine.add_request(StageInput(rid, prompt_token_ids=c[:1], input_complete=False))
        engine.extend_request(rid, c[1:], last=True)


def _drain(engine, limit=10_000):
    """Every step's deltas [(request, audio)] in order, and the finished outputs."""
    steps, outs = [], {}
    while engine.has_unfinished():
        step = engine.step()
        steps.append([(d.request_id, d.audio) for d in step.deltas])
        outs.update({o.request_id: o for o in step.finished + step.aborted})
        assert len(steps) < limit, "the engine never finished"
    return steps, outs


CODES = {f"s{i}": np.random.default_rng(i).integers(0, 8000, n).tolist() for i, n in enumerate([60, 41, 23])}


@pytest.mark.slow
def test_threaded_vocoder_gives_the_inline_waveforms_bitwise_in_order(token2wav_stage, threaded):
    inline = _engine(token2wav_stage)
    _add(inline, CODES)
    want_steps, want = _drain(inline)
    engine = _engine(threaded)
    _add(engine, CODES)
    steps, got = _drain(engine)
    used = threaded.stats()["vocoder_time_s"]
    assert used > 0  # later pieces went through the thread
    # First pieces: vocoded in the step their ODE ended, as inline (the first step ends every first window).
    assert sorted(rid for rid, _ in steps[0]) == sorted(rid for rid, _ in want_steps[0]) == sorted(CODES)
    for rid in CODES:
        assert got[rid].finish_reason == "stop"
        np.testing.assert_array_equal(got[rid].audio, want[rid].audio)
        # the pieces, joined in the order they left, are the waveform: none lost, none twice, none swapped
        pieces = [a for step in steps for r, a in step if r == rid]
        np.testing.assert_array_equal(np.concatenate(pieces), want[rid].audio)
        assert len(pieces) >= 2
    assert not threaded._flights and not threaded._vocoding


def test_vocoder_thread_must_be_a_boolean(tiny_omni):
    from stages.qwen2_5_omni_token2wav import Qwen2_5OmniToken2WavStage

    with pytest.raises(ValueError, match="vocoder_thread: must be true or false"):
        Qwen2_5OmniToken2WavStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"),
                                       model_kwargs={"vocoder_thread": "yes"})


@pytest.mark.slow
def test_a_vocoder_failure_fails_its_stream_alone(threaded, monkeypatch):
    real = threaded._vocode

    def vocode(flight):
        if flight.stream.codes == CODES["s1"] and not flight.first:  # on the thread
            raise RuntimeError("vocoder broke")
        return real(flight)

    monkeypatch.setattr(threaded, "_vocode", vocode)
    engine = _engine(threaded)
    _add(engine, CODES)
    _, outs = _drain(engine)
    assert outs["s1"].finish_reason == "error" and "vocoder broke" in str(outs["s1"].error)
    assert outs["s0"].finish_reason == outs["s2"].finish_reason == "stop"
    assert not threaded._flights and not threaded._vocoding


@pytest.mark.slow
def test_an_abort_while_a_piece_is_at_the_vocoder_drops_it(threaded, monkeypatch):
    """The vocoder is held on s0's second piece; s0 is aborted meanwhile: it finishes as aborted, its piece
    never leaves, and the other stream still gets all its audio."""
    release, held = threading.Event(), threading.Event()
    real = threaded._vocode

    def vocode(flight):
        if flight.stream.codes == CODES["s0"] and not flight.first:  # on the thread
            held.set()
            assert release.wait(30)
        return real(flight)

    monkeypatch.setattr(threaded, "_vocode", vocode)
    engine = _engine(threaded)
    _add(engine, {"s0": CODES["s0"], "s2": CODES["s2"]})
    deltas = []
    while not held.is_set():
        deltas += [d.request_id for d in engine.step().deltas]
    engine.abort("s0")
    release.set()
    steps, outs = _drain(engine)
    deltas += [rid for step in steps for rid, _ in step]
    assert outs["s0"].finish_reason == "abort"
    assert deltas.count("s0") == 1  # its first piece only
    assert outs["s2"].finish_reason == "stop" and outs["s2"].audio.size > 0
    assert not threaded._flights and not threaded._vocoding


@pytest.mark.slow
def test_closing_the_engine_stops_the_vocoder_thread(tiny_omni):
    from stages.qwen2_5_omni_token2wav import Qwen2_5OmniToken2WavStage

    stage = Qwen2_5OmniToken2WavStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"),
                                           model_kwargs={"vocoder_thread": True})
    before = set(threading.enumerate())
    engine = _engine(stage)
    _add(engine, {"s0": CODES["s0"]})
    _drain(engine)
    assert stage._vocoder is not None
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("omni-vocoder")]
    assert len(mine) == 1
    engine.close()
    assert stage._vocoder is None and not mine[0].is_alive()
