"""The one-shot engine's continuous batching of pieces that take several steps (omni/engine/in_flight.py),
with a stage model that needs no weights: any model with the work-item hooks gets it, first pieces go
ahead, a pack that fails fails only its failing item's stream, and the worker threads give the same pieces."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
from omni.engine.stage_model import OneShotStageModel
from omni.messages import StageInput
from omni.stage_info import StageInfo

STEPS = 3  # steps of work per item


@dataclass(eq=False)
class _Stream:
    codes: list[int]
    complete: bool = False
    done: int = 0
    pieces: int = 0


@dataclass(eq=False)
class _Item:
    stream: _Stream
    start: int
    end: int
    steps: int = 0


class Counter(OneShotStageModel):
    """A piece is 2 codes (the first piece 1); its audio, after STEPS steps, is its codes as floats. A code < 0
    makes every step it is in fail."""

    info = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=True)
    pieces_span_steps = True
    max_model_len = 1000

    def __init__(self):
        self.packs: list[list[int]] = []  # each step_items call's item starts

    def prepare_stream(self, inp, seed):
        return _Stream(list(inp.prompt_token_ids))

    def extend_stream(self, state, inp, last):
        state.codes += list(inp.prompt_token_ids)
        state.complete = last

    def _end(self, state):
        end = state.done + (1 if state.pieces == 0 else 2)
        if end <= len(state.codes):
            return end
        return len(state.codes) if state.complete and state.done < len(state.codes) else None

    def stream_ready(self, state):
        return self._end(state) is not None

    def start_item(self, state):
        end = self._end(state)
        return None if end is None else _Item(state, state.done, end)

    def item_size(self, item):
        return item.end - item.start

    def step_items(self, items):
        self.packs.append([i.start for i in items])
        if any(c < 0 for i in items for c in i.stream.codes[i.start:i.end]):
            raise RuntimeError("bad code")
        for i in items:
            i.steps += 1

    def item_done(self, item):
        return item.steps >= STEPS

    def end_item(self, item):
        item.stream.done, item.stream.pieces = item.end, item.stream.pieces + 1
        return item.stream.complete and item.end >= len(item.stream.codes)

    def finish_item(self, item):
        return {"audio": np.asarray(item.stream.codes[item.start:item.end], np.float32), "sampling_rate": 10}


def _run(codes: dict[str, list[int]], **config):
    engine = OneShotStageEngine(OneShotEngineConfig("voice", Counter, None, **config), model=Counter())
    for rid, c in codes.items():
        engine.add_request(StageInput(rid, prompt_token_ids=c[:1], input_complete=False))
        engine.extend_request(rid, c[1:], last=True)
    outs, deltas = {}, []
    while engine.has_unfinished():
        step = engine.step()
        deltas.append([(d.request_id, d.audio.tolist()) for d in step.deltas])
        outs.update({o.request_id: o for o in step.finished + step.aborted})
        assert len(deltas) < 1000
    assert not engine.in_flight.flights and not engine.in_flight.finishing
    engine.close()
    return outs, deltas, engine


CODES = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8], "c": [9, 10, 11, 12]}


@pytest.mark.parametrize("threads", [{}, {"finish_thread": True}, {"compute_threads": 2},
                                     {"finish_thread": True, "compute_threads": 2}])
def test_every_stream_gets_its_pieces_in_order_first_pieces_in_the_first_step(threads):
    outs, deltas, engine = _run(CODES, **threads)
    assert sorted(rid for rid, _ in deltas[0]) == sorted(CODES)  # first items run to their end at once
    for rid, c in CODES.items():
        assert outs[rid].finish_reason == "stop"
        assert outs[rid].audio.tolist() == c
        assert sum((a for step in deltas for r, a in step if r == rid), []) == c
    assert engine.stats().extra["batch_calls"] > 0


def test_later_items_step_together_one_unit_a_step():
    model_packs = _run(CODES)[2].model.packs
    assert [sorted(p) for p in model_packs[:STEPS]] == [[0, 0, 0]] * STEPS  # the first items, to their end
    assert sorted(model_packs[STEPS]) == [1, 1, 1]  # then every second item in one pack


def test_a_failing_item_in_a_pack_fails_its_stream_alone():
    outs, _, _ = _run({"ok": [1, 2, 3, 4, 5], "bad": [1, 2, -3, 4], "ok2": [6, 7, 8]}, compute_threads=2)
    assert outs["bad"].finish_reason == "error" and "bad code" in str(outs["bad"].error)
    assert outs["ok"].audio.tolist() == [1, 2, 3, 4, 5] and outs["ok2"].audio.tolist() == [6, 7, 8]
