"""One request's life in a StageEngine: ids reused after finish or abort, admission control."""
from __future__ import annotations

import logging

import pytest

from omni.sampling_params import SamplingParams
from omni.messages import StageInput
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion


def _inp(rid, prompt, max_tokens=4):
    return StageInput(rid, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


# ----------------------------------------------------------------- request ids
def test_finished_id_is_reused_with_no_step_in_between(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(_inp("r1", [5, 6, 7]))
    first = run_to_completion(engine)["r1"]
    engine.add_request(_inp("r1", [8, 9, 10, 11]))
    engine.add_request(_inp("innocent", [12, 13]))
    outs = run_to_completion(engine)
    assert outs["r1"].error is None and outs["r1"].prompt_token_ids == [8, 9, 10, 11]
    assert outs["innocent"].error is None and len(outs["innocent"].token_ids) == 4
    assert first.prompt_token_ids == [5, 6, 7]
    assert_no_leak(engine)


def test_aborted_id_is_reused_at_once(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(_inp("a", list(range(3, 40)), max_tokens=50))
    engine.add_request(_inp("b", list(range(5, 20))))
    engine.step()
    engine.step()
    engine.abort("a")  # released now: blocks, runner and model state
    engine.add_request(_inp("a", [7, 8, 9], max_tokens=3))
    step = engine.step()
    assert [o.finish_reason for o in step.aborted] == ["abort"]
    assert step.aborted[0].prompt_token_ids == list(range(3, 40))  # the report is the old request's
    outs = run_to_completion(engine)
    assert outs["a"].finish_reason == "length" and outs["a"].prompt_token_ids == [7, 8, 9]
    assert len(outs["a"].token_ids) == 3 and outs["b"].error is None
    assert_no_leak(engine)


def test_a_running_id_is_a_duplicate(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(_inp("x", [5, 6, 7]))
    engine.step()
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        engine.add_request(_inp("x", [9, 9, 9]))
    out = run_to_completion(engine)["x"]
    assert out.prompt_token_ids == [5, 6, 7] and len(out.token_ids) == 4  # the running one is untouched
    assert_no_leak(engine)


def test_finished_ids_leave_the_step(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(_inp("short", [5, 6], max_tokens=1))
    engine.add_request(_inp("long", [7, 8], max_tokens=3))
    step = engine.step()
    assert step.finished_req_ids == ["short"]
    assert "short" not in engine.runner.states and "long" in engine.runner.states  # released in that step
    assert engine.step().finished_req_ids == []
    assert engine.step().finished_req_ids == ["long"]
    assert not engine.has_unfinished()  # no further step is needed to clean up
    assert_no_leak(engine)


# ------------------------------------------------------------------ admission
def test_kv_cache_smaller_than_max_model_len_lowers_it_with_a_warning(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="omni.engine.engine_config"):
        engine = make_engine(tiny_llama, name="thinker", num_blocks=8, block_size=4, max_model_len=256)
    assert engine.max_model_len == 32 == engine.stats().max_model_len
    msg = caplog.text
    assert "stage thinker" in msg and "holds 32 tokens (8 blocks of 4)" in msg
    assert "max_model_len 256" in msg and "lowered to 32" in msg


def test_max_tokens_fit_generates_up_to_max_model_len_instead_of_refusing(tiny_llama):
    """SamplingParams.max_tokens_fit (the Realtime API's max_output_tokens is a bound): a prompt that leaves less
    room than max_tokens generates to max_model_len and ends "length"; a prompt that leaves none is still refused."""
    engine = make_engine(tiny_llama, name="thinker", num_blocks=64, block_size=4, max_model_len=32)
    fit = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30, ignore_eos=True, max_tokens_fit=True)
    engine.add_request(StageInput("fit", prompt_token_ids=list(range(5, 25)), sampling_params=fit))
    with pytest.raises(ValueError, match="exceed max_model_len 32"):  # without the flag: refused, as before
        engine.add_request(_inp("plain", list(range(5, 25)), max_tokens=30))
    with pytest.raises(ValueError, match="prompt: 32 tokens"):  # no room at all
        engine.add_request(StageInput("full", prompt_token_ids=list(range(5, 37)), sampling_params=fit))
    reserved = fit.model_copy(update={"reserve_tokens": 4})  # 4 tokens kept free for the stages after it
    engine.add_request(StageInput("reserved", prompt_token_ids=list(range(5, 25)), sampling_params=reserved))
    with pytest.raises(ValueError, match="prompt: 28 tokens leave no room"):
        engine.add_request(StageInput("no-room", prompt_token_ids=list(range(5, 33)), sampling_params=reserved))
    outs = run_to_completion(engine)
    assert outs["fit"].finish_reason == "length" and len(outs["fit"].token_ids) == 12  # 20 + 12 = max_model_len
    assert len(outs["reserved"].token_ids) == 8  # 20 + 8 + 4 = max_model_len
    assert_no_leak(engine)


def test_request_that_cannot_fit_is_rejected_at_once_and_the_batch_runs(tiny_llama):
    engine = make_engine(tiny_llama, name="thinker", num_blocks=8, block_size=4, max_model_len=256)
    engine.add_request(_inp("innocent", [5, 6, 7]))
    with pytest.raises(ValueError) as ei:
        engine.add_request(_inp("big", list(range(100, 140))))
    msg = str(ei.value)
    assert msg.startswith("prompt: 40 tokens + max_tokens 4 = 44 exceed max_model_len 32 of stage 'thinker'")
    assert "lowered from 256: the KV cache holds 8 blocks of 4 tokens" in msg
    with pytest.raises(ValueError, match=r"prompt: 3 tokens \+ max_tokens 30 = 33 exceed max_model_len 32"):
        engine.add_request(_inp("long_answer", [5, 6, 7], max_tokens=30))
    outs = run_to_completion(engine)
    assert set(outs) == {"innocent"} and len(outs["innocent"].token_ids) == 4
    assert_no_leak(engine)


def test_a_request_exactly_as_long_as_the_cache_runs_to_completion(tiny_llama):
    """prompt + max_tokens == max_model_len == what the cache holds: admitted, and it finishes (alone
    if need be: it may preempt the others), never waiting forever."""
    engine = make_engine(tiny_llama, num_blocks=8, block_size=4)
    engine.add_request(_inp("other", [9] * 10, max_tokens=6))
    engine.add_request(_inp("full", list(range(3, 31)), max_tokens=4))  # 28 + 4 = 32
    outs = run_to_completion(engine)
    assert len(outs["full"].token_ids) == 4 and outs["full"].finish_reason == "length"
    assert len(outs["other"].token_ids) == 6
    assert_no_leak(engine)
