"""token2wav's threads (the one-shot engine's worker threads: omni/engine/in_flight.py).

The vocoder thread (model_kwargs.vocoder_thread: the engine's finish_thread): BigVGAN of a stream's later windows runs on a thread of
its own while the DiT steps the windows in flight. The same ops on the same inputs, so while every stream
fits in a step the waveforms are bitwise those of the inline stage (with more, windows may pack otherwise:
the DiT's packing bound); a stream's pieces leave in order, its first piece in the step its ODE ends; a
failure there fails that stream alone, and an abort drops its pieces.

Two DiT threads (model_kwargs.dit_threads: 2: the engine's compute_threads): each Runge-Kutta step of the windows in flight runs as two
packs of about equal frames, one on a second thread; a window's values are those of the one-pack step up to
the blocking of fp32 sums (a pack is another packing), and a window that fails still fails alone."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
from omni.messages import StageInput


THREADED = {"finish_thread": True}
TWO_DIT_THREADS = {"finish_thread": True, "compute_threads": 2}


def _engine(model, max_num_seqs=4, **threads):
    return OneShotStageEngine(OneShotEngineConfig("token2wav", type(model), None, max_num_seqs=max_num_seqs,
                                                  **threads), model=model)


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


def _run_both(stage, threads):
    """CODES streamed through an engine without threads and one with `threads`: ((steps, outputs) inline,
    (steps, outputs) threaded), and the threaded engine (not closed)."""
    runs = []
    for kw in ({}, threads):
        engine = _engine(stage, **kw)
        _add(engine, CODES)
        runs.append(_drain(engine))
    return runs, engine


CODES = {f"s{i}": np.random.default_rng(i).integers(0, 8000, n).tolist() for i, n in enumerate([60, 41, 23])}


@pytest.mark.slow
def test_threaded_vocoder_gives_the_inline_waveforms_bitwise_in_order(token2wav_stage):
    ((want_steps, want), (steps, got)), threaded = _run_both(token2wav_stage, THREADED)
    used = threaded.stats().extra["finish_thread_time_s"]
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
    assert not threaded.in_flight.flights and not threaded.in_flight.finishing
    threaded.close()


@pytest.mark.slow
def test_with_more_streams_than_a_step_takes_the_audio_is_within_the_packing_bound(token2wav_stage):
    """max_num_seqs 2, three streams: with the vocoder thread a stream's next window starts before its piece is
    back, so windows may step in other packs than inline; each waveform is still inline's within the bound."""
    from tests.stages.omni_utils import wave_atol

    codes = {f"s{i}": np.random.default_rng(i).integers(0, 8000, n).tolist() for i, n in enumerate([120, 90, 60])}
    outs = []
    for threads in ({}, THREADED):
        threaded = _engine(token2wav_stage, max_num_seqs=2, **threads)
        _add(threaded, codes)
        outs.append(_drain(threaded)[1])
    want, got = outs
    for rid in codes:
        atol = wave_atol(token2wav_stage, want[rid].audio, 64 * token2wav_stage.repeats)
        assert got[rid].finish_reason == "stop" and got[rid].audio.shape == want[rid].audio.shape
        assert np.abs(got[rid].audio - want[rid].audio).max() <= atol
    assert not threaded.in_flight.flights and not threaded.in_flight.finishing
    threaded.close()


@pytest.mark.parametrize("kwargs,match", [({"vocoder_thread": "yes"}, "vocoder_thread: must be true or false"),
                                          ({"dit_threads": 3}, "dit_threads: must be 1 or 2, got 3"),
                                          ({"dit_threads": True}, "dit_threads: must be 1 or 2"),
                                          ({"dit_threads": 2.0}, "dit_threads: must be 1 or 2, got 2.0")])
def test_thread_options_are_checked(kwargs, match):
    from omni.pipeline.engine_factory import one_shot_threads

    with pytest.raises(ValueError, match=match):
        one_shot_threads(dict(kwargs))


def test_thread_options_leave_the_model_kwargs():
    from omni.pipeline.engine_factory import one_shot_threads

    kwargs = {"chunk_codes": 50, "vocoder_thread": True, "dit_threads": 2}
    assert one_shot_threads(kwargs) == {"finish_thread": True, "compute_threads": 2}
    assert kwargs == {"chunk_codes": 50}


class _Window:
    def __init__(self, codes: int):
        self.size = codes


@pytest.mark.parametrize("sizes,loads", [([20], None), ([20, 20], (20, 20)), ([124, 124, 74, 20], (198, 144)),
                                         ([200, 20, 20, 20], (200, 60)), ([70, 124, 106, 20, 20], (164, 176))])
def test_a_step_splits_into_two_packs_of_about_equal_frames(sizes, loads):
    from omni.engine.in_flight import packs as split

    group = [_Window(n) for n in sizes]
    packs = split(group)
    if loads is None:
        assert packs == [group]  # a lone window is not split
        return
    assert sorted(id(w) for p in packs for w in p) == sorted(map(id, group))  # every window once
    assert tuple(sum(w.size for w in p) for p in packs) == loads
    for p in packs:  # each pack keeps the group's order (oldest first)
        assert [group.index(w) for w in p] == sorted(group.index(w) for w in p)


@pytest.mark.slow
def test_two_dit_threads_give_the_one_thread_pieces(token2wav_stage):
    from tests.stages.omni_utils import wave_atol

    ((_, want), (_, got)), two_dit_threads = _run_both(token2wav_stage, TWO_DIT_THREADS)
    assert two_dit_threads.in_flight.threads.started[1]  # steps of several windows ran in two packs
    for rid in CODES:
        atol = wave_atol(token2wav_stage, want[rid].audio, 64 * token2wav_stage.repeats)  # windows <= 64 codes
        assert got[rid].finish_reason == "stop" and got[rid].audio.shape == want[rid].audio.shape
        assert np.abs(got[rid].audio - want[rid].audio).max() <= atol
    n = min(want["s0"].audio.size, want["s1"].audio.size)
    other = np.abs(want["s0"].audio[:n] - want["s1"].audio[:n]).max()
    assert other > 10 * atol  # the bound would catch a swapped stream
    assert not two_dit_threads.in_flight.flights and not two_dit_threads.in_flight.finishing
    two_dit_threads.close()


@pytest.mark.slow
def test_a_window_failing_in_a_two_pack_step_fails_alone(token2wav_stage):
    engine = _engine(token2wav_stage, **TWO_DIT_THREADS)
    codes = {"ok": CODES["s0"], "bad": CODES["s1"], "ok2": CODES["s2"]}
    _add(engine, codes)
    assert len(engine.step().deltas) == 3  # the first windows, to their end together
    assert not engine.step().deltas  # the second windows admitted, one Runge-Kutta step taken in two packs
    assert len(engine.in_flight.flights) == 3
    bad = engine._streams["bad"].work
    bad.flight.item.ode.state = bad.flight.item.ode.state[:, :3]
    _, outs = _drain(engine)
    assert outs["bad"].finish_reason == "error"
    assert outs["ok"].finish_reason == outs["ok2"].finish_reason == "stop"
    assert not engine.in_flight.flights and not engine.in_flight.finishing
    engine.close()


@pytest.mark.slow
def test_a_vocoder_failure_fails_its_stream_alone(token2wav_stage, monkeypatch):
    real = token2wav_stage.finish_item

    def vocode(window):
        if window.stream.codes == CODES["s1"] and window.start > 0:  # not the first window: on the thread
            raise RuntimeError("vocoder broke")
        return real(window)

    monkeypatch.setattr(token2wav_stage, "finish_item", vocode)
    engine = threaded = _engine(token2wav_stage, **THREADED)
    _add(engine, CODES)
    _, outs = _drain(engine)
    assert outs["s1"].finish_reason == "error" and "vocoder broke" in str(outs["s1"].error)
    assert outs["s0"].finish_reason == outs["s2"].finish_reason == "stop"
    assert not threaded.in_flight.flights and not threaded.in_flight.finishing
    threaded.close()


@pytest.mark.slow
def test_an_abort_while_a_piece_is_at_the_vocoder_drops_it(token2wav_stage, monkeypatch):
    """The vocoder is held on s0's second piece; s0 is aborted meanwhile: it finishes as aborted, its piece
    never leaves, and the other stream still gets all its audio."""
    release, held = threading.Event(), threading.Event()
    real = token2wav_stage.finish_item

    def vocode(window):
        if window.stream.codes == CODES["s0"] and window.start > 0:  # not the first window: on the thread
            held.set()
            assert release.wait(30)
        return real(window)

    monkeypatch.setattr(token2wav_stage, "finish_item", vocode)
    engine = threaded = _engine(token2wav_stage, **THREADED)
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
    assert not threaded.in_flight.flights and not threaded.in_flight.finishing
    threaded.close()


@pytest.mark.slow
def test_closing_the_engine_stops_the_vocoder_thread(token2wav_stage):
    before = set(threading.enumerate())
    engine = _engine(token2wav_stage, **THREADED)
    _add(engine, {"s0": CODES["s0"]})
    _drain(engine)
    assert engine.in_flight.threads.started[0]
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("omni-finish")]
    assert len(mine) == 1
    engine.close()
    assert not engine.in_flight.threads.started[0] and not mine[0].is_alive()


@pytest.mark.slow
def test_closing_the_engine_stops_the_dit_thread(token2wav_stage):
    before = set(threading.enumerate())
    engine = _engine(token2wav_stage, compute_threads=2)
    _add(engine, {"s0": CODES["s0"], "s1": CODES["s1"]})
    _drain(engine)
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("omni-compute")]
    assert len(mine) == 1 and not engine.in_flight.threads.started[0]  # no vocoder thread unless asked
    engine.close()
    assert not engine.in_flight.threads.started[1] and not mine[0].is_alive()
