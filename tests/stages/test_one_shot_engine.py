"""OneShotStageEngine with the Qwen2.5-Omni token2wav stage (no KV cache)."""
from __future__ import annotations

import numpy as np
import pytest

from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
from omni.messages import StageInput
from stages.qwen2_5_omni.payloads import CodesToWave
from tests.stages.omni_utils import wave_atol


def _config(model, name="token2wav", **kw):
    return OneShotEngineConfig(name, type(model), None, **kw)


def _drain(engine):
    outs = {}
    while engine.has_unfinished():
        step = engine.step()
        for o in step.aborted + step.finished:
            outs[o.request_id] = o
    return outs


@pytest.mark.slow
def test_token2wav_engine_deterministic_and_isolated(token2wav_stage):
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=2), model=token2wav_stage)
    codes = [11, 500, 2048, 7, 7, 900]
    engine.add_request(StageInput("a", prompt_token_ids=codes))
    engine.add_request(StageInput("b", prompt_token_ids=codes, sampling_params={"seed": 3}))
    engine.add_request(StageInput("c", prompt_token_ids=codes, payload=CodesToWave("Ethan")))
    engine.add_request(StageInput("d", prompt_token_ids=codes))
    engine.abort("d")
    outs = _drain(engine)
    assert outs["d"].finish_reason == "abort" and outs["d"].audio is None
    a, b, c = outs["a"].audio, outs["b"].audio, outs["c"].audio
    assert a.dtype == np.float32 and a.ndim == 1 and a.size > 0 and np.isfinite(a).all()
    assert not np.array_equal(a, b)  # another noise seed
    assert not np.array_equal(a, c)  # another speaker
    engine.add_request(StageInput("a2", prompt_token_ids=codes))
    np.testing.assert_array_equal(_drain(engine)["a2"].audio, a)  # same codes + seed: same waveform
    st = engine.stats().as_dict()
    assert st["finished"] == 4 and st["prefix_caching"] is False and st["waiting"] == 0


def test_token2wav_bad_requests_are_clear_errors(token2wav_stage):
    engine = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(StageInput("x", prompt_token_ids=[10**6]))
    with pytest.raises(ValueError, match="speaker"):
        engine.add_request(StageInput("z", prompt_token_ids=[1, 2], payload=CodesToWave("Nobody")))
    assert not engine.has_unfinished()
    # no codes (a talker whose eos came first): no audio, no error
    engine.add_request(StageInput("y", prompt_token_ids=[]))
    (out,) = engine.step().finished
    assert out.error is None and out.audio is not None and len(out.audio) == 0


def test_autoregressive_model_is_rejected(thinker_stage):
    with pytest.raises(ValueError, match="autoregressive"):
        OneShotStageEngine(_config(thinker_stage, name="x"), model=thinker_stage)


def _run(engine, requests):
    for rid, codes, payload, sp in requests:
        engine.add_request(StageInput(rid, prompt_token_ids=codes, payload=payload, sampling_params=sp))
    return _drain(engine)


@pytest.mark.slow
def test_batched_step_equals_one_request_at_a_time(token2wav_stage):
    """The engine's batched step (the DiT in lockstep over 4 requests of different lengths, speakers and
    seeds) gives the waveforms of one request per step: bitwise where the BLAS gives a matrix product's
    rows independently of their number (see test_qwen2_5_omni_dit), within wave_atol in any case."""
    rng = np.random.default_rng(1)
    speaker = next(iter(token2wav_stage.speakers))
    requests = [("a", rng.integers(0, 8000, 30).tolist(), None, None),
                ("b", rng.integers(0, 8000, 7).tolist(), CodesToWave(speaker), None),
                ("c", rng.integers(0, 8000, 30).tolist(), None, {"seed": 4}),
                ("d", [5], None, None)]
    alone = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=1), model=token2wav_stage)
    batched = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=4), model=token2wav_stage)
    want, got = _run(alone, requests), _run(batched, requests)
    for rid, codes, _, _ in requests:
        assert got[rid].finish_reason == "stop" and got[rid].audio.shape == want[rid].audio.shape
        atol = wave_atol(token2wav_stage, want[rid].audio, len(codes) * token2wav_stage.repeats)
        assert np.abs(got[rid].audio - want[rid].audio).max() <= atol
    assert np.abs(want["a"].audio - want["c"].audio).max() > 10 * atol  # a swap would show
    assert batched.stats().as_dict()["batch_calls"] == 1 and alone.stats().as_dict()["batch_calls"] == 0


@pytest.mark.slow
def test_streamed_windows_of_several_requests_batched_equal_one_at_a_time(token2wav_stage):
    """Windows of several streams ready in one step run together; every piece is the one of a stream run
    alone (first windows, later ones, a short last one), as in test_batched_step_equals_one_request_at_a_time."""
    rng = np.random.default_rng(2)
    codes = {"s0": rng.integers(0, 8000, 40).tolist(), "s1": rng.integers(0, 8000, 23).tolist(),
             "s2": rng.integers(0, 8000, 31).tolist()}

    def pieces(max_num_seqs):
        engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=max_num_seqs), model=token2wav_stage)
        for rid, c in codes.items():
            engine.add_request(StageInput(rid, prompt_token_ids=c[:1], input_complete=False))
            engine.extend_request(rid, c[1:], last=True)
        got: dict[str, list[np.ndarray]] = {}
        outs = {}
        while engine.has_unfinished():
            step = engine.step()
            for d in step.deltas:
                got.setdefault(d.request_id, []).append(d.audio)
            outs.update({o.request_id: o for o in step.finished})
        return got, outs, engine.stats().as_dict()["batch_calls"]

    want, want_outs, _ = pieces(1)
    got, outs, calls = pieces(3)
    assert calls >= 2  # the first windows together, then the later ones
    for rid in codes:
        assert len(got[rid]) == len(want[rid]) >= 2
        atol = wave_atol(token2wav_stage, want_outs[rid].audio, 64 * token2wav_stage.repeats)  # windows <= 64 codes
        for a, b in zip(got[rid], want[rid]):
            assert a.shape == b.shape and np.abs(a - b).max() <= atol
        assert np.abs(outs[rid].audio - want_outs[rid].audio).max() <= atol


def _stream_requests(engine, codes_by_rid):
    for rid, c in codes_by_rid.items():
        engine.add_request(StageInput(rid, prompt_token_ids=c[:1], input_complete=False))
        engine.extend_request(rid, c[1:], last=True)


def _stream_pieces(engine):
    """Every delta's (request, audio) in order, and the finished outputs."""
    order, outs = [], {}
    while engine.has_unfinished():
        step = engine.step()
        order += [(d.request_id, d.audio) for d in step.deltas]
        outs.update({o.request_id: o for o in step.finished})
    return order, outs


@pytest.mark.slow
def test_a_newcomers_first_window_goes_ahead_of_a_window_in_flight(token2wav_stage):
    """A window advances one Runge-Kutta step per engine step, so a stream that arrives while another's
    long window is part done gets its first audio before that window ends; the old stream's ODE was
    put aside, not restarted, and its pieces are those it gets alone (within the packing bound)."""
    rng = np.random.default_rng(5)
    old, new = rng.integers(0, 8000, 60).tolist(), rng.integers(0, 8000, 30).tolist()
    alone = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
    _stream_requests(alone, {"old": old})
    want, want_outs = _stream_pieces(alone)

    engine = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
    _stream_requests(engine, {"old": old})
    first = []
    while not first:
        first = engine.step().deltas  # the old stream's first piece
    engine.step()  # its second window: one Runge-Kutta step done
    (flight,) = engine.in_flight.flights
    assert flight.item.ode.steps_done == 1 and not flight.first
    _stream_requests(engine, {"new": new})
    order, outs = _stream_pieces(engine)
    rids = [rid for rid, _ in order]
    assert rids.index("new") < rids.index("old")
    old_pieces = [first[0].audio] + [a for rid, a in order if rid == "old"]
    atol = wave_atol(token2wav_stage, want_outs["old"].audio, 64 * token2wav_stage.repeats)
    assert len(old_pieces) == len(want)
    assert all(a.shape == b.shape and np.abs(a - b).max() <= atol for a, (_, b) in zip(old_pieces, want))
    assert outs["new"].metrics["ttft_s"] < outs["old"].metrics["e2e_s"]
    assert not engine.in_flight.flights


@pytest.mark.slow
def test_windows_at_different_steps_step_together_and_give_the_pieces_of_each_alone(token2wav_stage, monkeypatch):
    """Continuous batching of the ODE: streams that arrive one after another have their windows in flight
    at different Runge-Kutta steps; those steps run packed in one velocity call per evaluation (each
    window its own time), and every piece equals the piece of that stream run alone, within the bound of
    a reordered sum."""
    import stages.qwen2_5_omni.token2wav as t2w

    mixed: list[list[int]] = []
    real = t2w.ode_step

    def spy(dit, windows, times, guidance_scale):
        steps = [w.steps_done for w in windows]
        if len(set(steps)) > 1:
            mixed.append(steps)
        return real(dit, windows, times, guidance_scale)

    rng = np.random.default_rng(6)
    codes = {f"s{i}": rng.integers(0, 8000, n).tolist() for i, n in enumerate([40, 25, 33])}
    want = {}
    for rid, c in codes.items():
        engine = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
        _stream_requests(engine, {rid: c})
        want[rid] = _stream_pieces(engine)
    monkeypatch.setattr(t2w, "ode_step", spy)
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=4), model=token2wav_stage)
    order, outs = [], {}
    for rid, c in codes.items():  # each arrives 3 steps after the one before
        _stream_requests(engine, {rid: c})
        for _ in range(3):
            step = engine.step()
            order += [(d.request_id, d.audio) for d in step.deltas]
            outs.update({o.request_id: o for o in step.finished})
    more, rest = _stream_pieces(engine)
    order += more
    outs.update(rest)
    assert mixed and all(len(s) >= 2 for s in mixed)
    for rid in codes:
        ref_pieces, ref_outs = want[rid]
        mine = [a for r, a in order if r == rid]
        atol = wave_atol(token2wav_stage, ref_outs[rid].audio, 64 * token2wav_stage.repeats)
        assert len(mine) == len(ref_pieces) >= 2
        assert all(a.shape == b.shape and np.abs(a - b).max() <= atol for a, (_, b) in zip(mine, ref_pieces))
        assert outs[rid].finish_reason == "stop"
    assert not engine.in_flight.flights


@pytest.mark.slow
def test_aborting_a_stream_mid_window_drops_its_work(token2wav_stage):
    engine = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
    _stream_requests(engine, {"a": np.random.default_rng(7).integers(0, 8000, 60).tolist()})
    assert engine.step().deltas  # its first window: to its end in one step
    engine.step()  # its second window: one Runge-Kutta step in
    (flight,) = engine.in_flight.flights
    assert flight.item.ode.steps_done == 1
    engine.abort("a")
    assert not engine.in_flight.flights
    assert [o.finish_reason for o in engine.step().aborted] == ["abort"]
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_a_failing_window_stepped_with_others_fails_alone(token2wav_stage):
    """Two windows in flight; one cannot step (its ODE state was cut short): the packed step fails, each
    window steps again alone, and only that stream fails."""
    rng = np.random.default_rng(8)
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=4), model=token2wav_stage)
    _stream_requests(engine, {"ok": rng.integers(0, 8000, 40).tolist(), "bad": rng.integers(0, 8000, 40).tolist()})
    assert len(engine.step().deltas) == 2  # both first windows, to their end together
    assert not engine.step().deltas  # both second windows admitted, one step taken together
    assert len(engine.in_flight.flights) == 2
    bad = engine._streams["bad"].work.flight.item.ode
    bad.state = bad.state[:, :3]
    _, outs = _stream_pieces(engine)
    assert outs["bad"].finish_reason == "error"
    assert outs["ok"].finish_reason == "stop" and outs["ok"].audio.size > 0
    assert not engine.in_flight.flights


@pytest.mark.slow
def test_a_window_that_cannot_start_fails_its_stream_alone(token2wav_stage):
    rng = np.random.default_rng(9)
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=4), model=token2wav_stage)
    _stream_requests(engine, {"ok": rng.integers(0, 8000, 20).tolist(), "bad": rng.integers(0, 8000, 20).tolist()})
    engine._streams["bad"].job.noise = engine._streams["bad"].job.noise[:, :3]
    _, outs = _stream_pieces(engine)
    assert outs["bad"].finish_reason == "error" and "noise" in str(outs["bad"].error)
    assert outs["ok"].finish_reason == "stop" and outs["ok"].audio.size > 0


@pytest.mark.slow
def test_newcomers_arriving_faster_than_a_first_window_slow_an_old_stream_but_never_stop_it(token2wav_stage):
    """A first window runs ahead of the others, but the windows it held back take their step before the
    next first window runs alone: with a newcomer at every step (a first window always ready), the old
    stream's window still ends, and the newcomers still get their first audio."""
    rng = np.random.default_rng(10)
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=64), model=token2wav_stage)
    _stream_requests(engine, {"old": rng.integers(0, 8000, 60).tolist()})
    while not engine.step().deltas:  # the old stream's first piece
        pass
    old_pieces, firsts, steps = 1, set(), 0
    windows = len(token2wav_stage._times)  # Runge-Kutta steps of a window, + 1
    while old_pieces < 2 and steps < 20 * windows * windows:
        _stream_requests(engine, {f"new{steps}": rng.integers(0, 8000, 12).tolist()})
        for d in engine.step().deltas:
            if d.request_id == "old":
                old_pieces += 1
            else:
                firsts.add(d.request_id)
        steps += 1
    assert old_pieces == 2, f"the old stream made no audio in {steps} steps"
    assert steps <= 2 * windows  # one step of its own at least every other step
    assert len(firsts) >= steps // 2 - 1  # newcomers keep their first audio coming
    for rid in list(engine._streams):
        engine.abort(rid)
    engine.step()
    assert not engine.in_flight.flights
