"""The engine benchmarks' stage and loop (omni/bench/engine_loop.py): an engine as engine_factory builds it
from StageConfig fields, driven step by step; each step reports the rows its forward pass computed and sampled."""
from __future__ import annotations

import pytest

from omni.bench import engine_loop
from omni.bench.workloads import Conversation
from omni.messages import StageInput
from omni.sampling_params import SamplingParams


@pytest.mark.slow  # builds a tiny engine
def test_engine_loop_runs_requests_to_the_end_and_reports_each_forward(tiny_llama):
    engine = engine_loop.engine("bench", "causal_lm", tiny_llama, emit_hidden_states=False, cuda_graphs=False,
                                scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    inputs = [StageInput(f"r{i}", prompt_token_ids=[100 + i] * (5 + i), sampling_params=sp) for i in range(2)]
    steps = list(engine_loop.steps(engine, inputs))
    assert not engine.has_unfinished()
    assert all(seconds >= 0 for _, seconds in steps)
    # the first step prefills both prompts and samples one token each; decode steps one row per request
    first = steps[0][0]
    assert (first.forward_rows, first.sampled_rows) == (5 + 6, 2)
    assert sum(s.sampled_rows for s, _ in steps) == 2 * 3
    assert sorted(o.request_id for s, _ in steps for o in s.finished) == ["r0", "r1"]
    [out] = engine_loop.run(engine, [StageInput("again", prompt_token_ids=[100] * 5, sampling_params=sp)])
    assert out.request_id == "again" and len(out.token_ids) == 3
    assert out.hidden_states is None  # emit_hidden_states=False reached the engine
    engine.close()


def test_conversation_turns_ask_each_question_when_its_turn_comes():
    drawn = []

    def questions():
        for q in ([], [3], [4, 5]):
            drawn.append(q)
            yield q

    conv = Conversation(ids=[1, 2])
    seen = []
    for turn, prompt in conv.turns(questions()):
        seen.append((turn, prompt, len(drawn)))
        conv.answer([9])
    assert seen == [(0, [1, 2], 1), (1, [1, 2, 9, 3], 2), (2, [1, 2, 9, 3, 9, 4, 5], 3)]
    chat = Conversation(messages=[])
    for _, prompt in chat.turns(["hi"]):
        chat.answer("hello")
    assert chat.prompt == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
