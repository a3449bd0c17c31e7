"""SamplingParams.stop (vLLM's stop strings) on the engine, against the same request run without them: the text
ends before the earliest stop string (or after it, include_stop_str_in_output), the token ids end with the token
that completed it, finish_reason 'stop' and stop_reason the string; streamed deltas never show a stop string and
concatenate to the final text."""
from __future__ import annotations

import pytest

from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import make_engine, run_one

PROMPT = list(range(40, 52))


def _run(engine, rid, stream=False, **params):
    return run_one(engine, rid, PROMPT, stream, **{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **params})


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    return make_engine(tiny_qwen2)


@pytest.fixture(scope="module")
def free(engine):
    """The reply without stop strings, and a stop string inside it that spans a token boundary."""
    out, _ = _run(engine, "free")
    tok = engine.tokenizer
    text = out.text
    ends = [len(tok.decode(out.token_ids[:k], skip_special_tokens=True)) for k in range(len(out.token_ids) + 1)]
    # the text of tokens 6..8 ends at ends[8]; take 4 characters across the boundary after token 6
    cut = next(e for e in ends[6:] if 2 <= e < len(text) - 2)
    stop = text[cut - 2: cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2, (text, stop)
    return out, stop


def test_the_text_ends_before_the_stop_string(engine, free):
    out, stop = free
    got, _ = _run(engine, "s1", stop=[stop])
    i = out.text.find(stop)
    assert got.text == out.text[:i] and got.finish_reason == "stop" and got.stop_reason == stop
    # the token ids: the free run's, up to the token that completed the string
    n = len(got.token_ids)
    assert got.token_ids == out.token_ids[:n]
    tok = engine.tokenizer
    assert stop in tok.decode(got.token_ids) and stop not in tok.decode(got.token_ids[:-1])


def test_include_stop_str_and_the_earliest_of_several(engine, free):
    out, stop = free
    i = out.text.find(stop)
    later = out.text[i + 3: i + 6]
    assert out.text.find(later) > i
    got, _ = _run(engine, "s2", stop=[later, stop], include_stop_str_in_output=True)
    assert got.text == out.text[: i + len(stop)] and got.stop_reason == stop
    none, _ = _run(engine, "s3", stop="\u2603 never")
    assert none.text == out.text and none.finish_reason == "length" and none.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_never_show_the_stop_string(engine, free, include):
    out, stop = free
    got, deltas = _run(engine, f"st{include}", stream=True, stop=[stop], include_stop_str_in_output=include)
    text = "".join(d.text for d in deltas)
    assert text == got.text == out.text[: out.text.find(stop) + (len(stop) if include else 0)]
    if not include:
        so_far = ""
        for d in deltas:
            so_far += d.text
            assert stop[0] not in so_far[out.text.find(stop):]  # nothing of the stop string went out
    assert deltas[-1].finished


def test_min_tokens_holds_stop_strings_back(engine, free, caplog):
    """vLLM's min_tokens: no stop string is looked for before that many tokens, and one that ended before then never
    stops the reply (the next occurrence, if any, does). A streamed stop raises no 'differs from its full decode'
    warning (the stream is cut on purpose)."""
    out, stop = free
    tok = engine.tokenizer
    ends = [len(tok.decode(out.token_ids[:k], skip_special_tokens=True)) for k in range(len(out.token_ids) + 1)]
    i = out.text.find(stop)
    past = next(k for k, e in enumerate(ends) if e >= i + len(stop))  # the token that completed it
    got, _ = _run(engine, "m1", stop=[stop], min_tokens=past + 1)
    later = out.text.find(stop, i + 1)
    if later < 0:
        assert got.text == out.text and got.stop_reason is None and got.finish_reason == "length"
    else:
        assert got.text == out.text[:later] and got.stop_reason == stop
    with caplog.at_level("WARNING", logger="omni.engine.io.outputs"):
        _run(engine, "m2", stream=True, stop=[stop])
    assert not [r for r in caplog.records if "differs from its full decode" in r.message]


def test_a_stage_without_a_tokenizer_ignores_stop_strings(tiny_qwen2):
    """One SamplingParams a caller gives every stage (stop included) must not fail a stage that makes no text (a
    talker): stop strings apply where there is text."""
    eng = make_engine(tiny_qwen2)
    eng.outputs.tokenizer = None  # the stage makes no text (its output assembly has no tokenizer)
    eng.add_request(StageInput("x", prompt_token_ids=PROMPT, sampling_params={"max_tokens": 3, "stop": ["a"],
                                                                             "ignore_eos": True}))
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step().finished})
    assert outs["x"].error is None and len(outs["x"].token_ids) == 3 and outs["x"].stop_reason is None


def test_stop_token_ids_report_the_token_as_stop_reason(engine, free):
    out, _ = free
    token = out.token_ids[5]
    got, _ = _run(engine, "t1", stop_token_ids=[token])
    assert got.token_ids[-1] == token and got.finish_reason == "stop" and got.stop_reason == token


def test_skip_special_tokens_false_keeps_them_in_the_text(engine, free):
    """vLLM's skip_special_tokens: forced to emit the eos token (logit_bias), its text shows only with false; the
    streamed deltas agree with the final text."""
    eos = engine.model.eos_token_id
    tok = engine.tokenizer
    for skip in (True, False):
        got, deltas = _run(engine, f"sp{skip}", stream=True, max_tokens=3, logit_bias={eos: 100.0},
                           skip_special_tokens=skip)
        assert got.token_ids == [eos] * 3
        assert got.text == ("" if skip else tok.decode([eos] * 3)) == "".join(d.text for d in deltas)
        assert skip or got.text


def test_stop_strings_are_validated():
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "a", "b"]).stop == ["a", "b"]
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(ValueError):
        SamplingParams(include_stop_str_in_output="yes")


@pytest.mark.parametrize("name,hint", [("n", "submit the prompt n times"), ("best_of", "submit the prompt"),
                                       ("guided_decoding", "structured_outputs")])
def test_vllm_fields_it_lacks_say_what_to_use(name, hint):
    """A vLLM SamplingParams field this one does not take names itself and what to do instead, through the Python
    API too (a RequestError naming sampling_params.<field>, its message without an empty location)."""
    from omni import Omni
    from omni.errors import RequestError
    from tests.fakes import chain_config, fake_factory

    with pytest.raises(ValueError, match=f"{name}: vLLM's {name} is not supported: .*{hint}"):
        SamplingParams(**{name: 2})
    with Omni(chain_config(), engine_factory=fake_factory) as o:
        with pytest.raises(RequestError) as e:
            o.generate("hi", {"thinker": {name: 2}}, use_tqdm=False)
    assert e.value.field == f"sampling_params.{name}" and ": :" not in e.value.message and hint in e.value.message
