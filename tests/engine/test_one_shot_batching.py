"""OneShotStageEngine's batched hooks, with stage models that need no weights: which hook runs, what a
failing batch does to the others, and the order of streamed pieces (first pieces ahead)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
from omni.engine.stage_model import OneShotStageModel
from omni.messages import StageInput
from omni.stage_info import StageInfo


@dataclass
class _Stream:
    codes: list[int]
    complete: bool = False
    done: int = 0
    pieces: list[np.ndarray] = field(default_factory=list)


class Echo(OneShotStageModel):
    """audio = the codes as floats; a code < 0 makes its request fail. Streams emit 2 codes a piece."""

    info = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
    max_model_len = 1000

    def __init__(self):
        self.single_calls = 0

    def prepare_generation(self, inp, seed):
        return list(inp.prompt_token_ids)

    def run_generation(self, job):
        self.single_calls += 1
        if min(job) < 0:
            raise RuntimeError(f"bad code {min(job)}")
        return {"audio": np.asarray(job, np.float32), "sampling_rate": 10}

    def prepare_stream(self, inp, seed):
        return _Stream(list(inp.prompt_token_ids))

    def extend_stream(self, state, inp, last):
        state.codes += list(inp.prompt_token_ids)
        state.complete = last

    def stream_ready(self, state):
        return len(state.codes) - state.done >= 2 or (state.complete and state.done < len(state.codes))

    def next_output(self, state):
        self.single_calls += 1
        piece = np.asarray(state.codes[state.done:state.done + 2], np.float32)
        if (piece < 0).any():
            raise RuntimeError("bad code")
        state.done += len(piece)
        state.pieces.append(piece)
        done = state.complete and state.done >= len(state.codes)
        return {"audio": piece, "sampling_rate": 10}, done

    def stream_result(self, state):
        return {"audio": np.concatenate(state.pieces), "sampling_rate": 10}


class BatchedEcho(Echo):
    """Echo with the batched hooks; a batch with a bad item raises (as one forward over them would)."""

    def __init__(self):
        super().__init__()
        self.batches: list[tuple[int, int]] = []  # (items, max_batch_tokens) per call

    def run_generation_batch(self, jobs, max_batch_tokens):
        self.batches.append((len(jobs), max_batch_tokens))
        if any(min(j) < 0 for j in jobs):
            raise RuntimeError("a bad code in the batch")
        return [{"audio": np.asarray(j, np.float32), "sampling_rate": 10} for j in jobs]

    def next_outputs(self, states, max_batch_tokens):
        self.batches.append((len(states), max_batch_tokens))
        if any(min(s.codes[s.done:s.done + 2]) < 0 for s in states):
            raise RuntimeError("a bad code in the batch")  # before any state changed
        out = []
        for s in states:
            self.single_calls -= 1  # what follows is the batch's work, not a one-at-a-time call
            out.append(Echo.next_output(self, s))
        return out


def _engine(model, **kw):
    return OneShotStageEngine(OneShotEngineConfig("voice", type(model), None, **kw), model=model)


def _drain(engine):
    outs, deltas = {}, []
    while engine.has_unfinished():
        step = engine.step()
        deltas.append([(d.request_id, d.audio.tolist()) for d in step.deltas])
        for o in step.aborted + step.finished:
            outs[o.request_id] = o
    return outs, deltas


@pytest.mark.parametrize("model_cls", [Echo, BatchedEcho])
def test_a_step_runs_its_requests_through_the_batched_hook_when_there_is_one(model_cls):
    model = model_cls()
    engine = _engine(model, max_num_seqs=3, max_batch_tokens=77)
    for i in range(4):
        engine.add_request(StageInput(f"r{i}", prompt_token_ids=[i, i + 1]))
    engine.add_request(StageInput("gone", prompt_token_ids=[9]))
    engine.abort("gone")
    first = engine.step()
    assert [o.request_id for o in first.finished] == ["r0", "r1", "r2"] and first.aborted[0].request_id == "gone"
    outs, _ = _drain(engine)
    outs.update({o.request_id: o for o in first.finished})
    for i in range(4):
        assert outs[f"r{i}"].finish_reason == "stop" and outs[f"r{i}"].audio.tolist() == [i, i + 1]
    stats = engine.stats().as_dict()
    if model_cls is BatchedEcho:
        assert model.batches == [(3, 77)] and model.single_calls == 1  # the last one alone
        assert stats["batch_calls"] == 1 and stats["batched_items"] == 3
    else:
        assert model.single_calls == 4 and stats["batch_calls"] == 0 and stats["batched_items"] == 0


def test_a_failing_batch_fails_only_its_bad_request():
    model = BatchedEcho()
    engine = _engine(model, max_num_seqs=4)
    for rid, codes in (("a", [1, 2]), ("bad", [3, -1]), ("c", [5])):
        engine.add_request(StageInput(rid, prompt_token_ids=codes))
    step = engine.step()
    outs = {o.request_id: o for o in step.finished}
    assert outs["a"].audio.tolist() == [1, 2] and outs["c"].audio.tolist() == [5]
    bad = outs["bad"]
    assert bad.finish_reason == "error" and bad.error.stage == "voice" and bad.error.request_id == "bad"
    assert "bad code -1" in bad.error.message
    assert model.batches == [(3, 2048)] and model.single_calls == 3  # the batch, then each one alone
    assert engine.stats().errors == 1 and not engine.has_unfinished()


def _streams(engine, codes_by_rid):
    for rid, codes in codes_by_rid.items():
        engine.add_request(StageInput(rid, prompt_token_ids=codes[:1], input_complete=False))
        engine.extend_request(rid, codes[1:], last=True)


def test_streams_ready_in_one_step_run_together_and_equal_one_at_a_time():
    codes = {"s0": [1, 2, 3, 4, 5], "s1": [6, 7, 8], "s2": [9, 10, 11, 12]}
    runs = {}
    for model_cls in (Echo, BatchedEcho):
        model = model_cls()
        engine = _engine(model, max_num_seqs=8)
        _streams(engine, codes)
        runs[model_cls] = _drain(engine) + (model,)
    (outs, deltas, _), (b_outs, b_deltas, batched) = runs[Echo], runs[BatchedEcho]
    assert b_deltas == deltas
    assert deltas[0] == [("s0", [1, 2]), ("s1", [6, 7]), ("s2", [9, 10])]  # one step, every stream's piece
    for rid, c in codes.items():
        assert b_outs[rid].audio.tolist() == outs[rid].audio.tolist() == c
    # s0's last piece is alone in its step: the one-at-a-time hook.
    assert batched.batches == [(3, 2048), (3, 2048)] and batched.single_calls == 1


def test_a_failing_stream_batch_fails_only_its_bad_stream_and_the_others_go_on():
    model = BatchedEcho()
    engine = _engine(model, max_num_seqs=8)
    _streams(engine, {"ok": [1, 2, 3], "bad": [4, -5, 6]})
    outs, deltas = _drain(engine)
    assert outs["bad"].finish_reason == "error" and outs["bad"].error.request_id == "bad"
    assert deltas[0] == [("ok", [1, 2])]  # its state was not touched by the failed batch: no piece skipped
    assert outs["ok"].finish_reason == "stop" and outs["ok"].audio.tolist() == [1, 2, 3]


def test_first_pieces_go_ahead_of_other_streams_later_pieces():
    model = BatchedEcho()
    engine = _engine(model, max_num_seqs=8)
    _streams(engine, {"old": [1, 2, 3, 4, 5, 6]})
    assert [d.request_id for d in engine.step().deltas] == ["old"]
    _streams(engine, {"new": [7, 8, 9]})
    # Both have a piece ready: the newcomer's first piece runs alone, the old stream's next one after it.
    assert [(d.request_id, d.audio.tolist()) for d in engine.step().deltas] == [("new", [7, 8])]
    assert [(d.request_id, d.audio.tolist()) for d in engine.step().deltas] == [("old", [3, 4]), ("new", [9])]
