"""vLLM's reply text where a reply ends, and its prompt fields, on the engine (tiny Qwen2, Qwen2's byte-level vocabulary):

- the eos or stop token that ended a reply stays in its token ids, but its text is left out of the reply's text
  (vLLM's detokenizer skips it) unless include_stop_str_in_output; streamed deltas agree with the final text;
- a reply cut (max_tokens) inside a multi-byte character ends before it, not with a U+FFFD (vLLM never emits
  incomplete bytes); a U+FFFD that a token spells stays;
- truncate_prompt_tokens keeps the prompt's last k tokens (-1: max_model_len), where the prompt is the caller's;
- spaces_between_special_tokens is accepted (as vLLM's fast detokenizer, it changes nothing here);
- detokenize false: the same tokens, no text (final or streamed); logprobs still carry their tokens' texts;
- skip_reading_prefix_cache: the whole prompt computed, nothing read from the cache; the same reply.
"""
from __future__ import annotations

import pytest

from omni.engine.io.detokenizer import final_decode
from omni.errors import RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, make_engine, run_one, run_to_completion

PROMPT = list(range(40, 52))


def _run(engine, rid, stream=False, prompt=PROMPT, **params):
    """The output, and the text its deltas streamed."""
    out, deltas = run_one(engine, rid, prompt, stream, **{"temperature": 0.0, "max_tokens": 16, **params})
    return out, "".join(d.text for d in deltas)


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    return make_engine(tiny_qwen2)


@pytest.fixture(scope="module")
def free(engine):
    """The reply with no stop of any kind (16 tokens)."""
    out, _ = _run(engine, "free", ignore_eos=True)
    assert len(out.token_ids) == 16
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_tokens_text_is_left_out(engine, free, stream):
    tok = engine.tokenizer
    k = next(i for i in range(3, 16) if free.token_ids[i] not in free.token_ids[:i] and tok.decode([free.token_ids[i]]))
    token = free.token_ids[k]
    got, streamed = _run(engine, f"st{stream}", stream=stream, stop_token_ids=[token])
    assert got.token_ids == free.token_ids[: k + 1] and got.stop_reason == token and got.finish_reason == "stop"
    assert got.text == tok.decode(free.token_ids[:k]) != tok.decode(free.token_ids[: k + 1])
    kept, kept_streamed = _run(engine, f"sk{stream}", stream=stream, stop_token_ids=[token],
                               include_stop_str_in_output=True)
    assert kept.token_ids == got.token_ids and kept.text == tok.decode(free.token_ids[: k + 1])
    if stream:
        assert streamed == got.text and kept_streamed == kept.text
    assert_no_leak(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_the_eos_tokens_text_is_left_out_with_special_tokens_shown(engine, stream):
    """skip_special_tokens false shows special tokens, but not the eos that ended the reply (vLLM's)."""
    eos = engine.model.eos_token_id
    tok = engine.tokenizer
    got, streamed = _run(engine, f"eos{stream}", stream=stream, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert got.token_ids == [eos] and got.text == "" and got.finish_reason == "stop"
    kept, kept_streamed = _run(engine, f"eosk{stream}", stream=stream, logit_bias={eos: 100.0},
                               skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept.text == tok.decode([eos]) and kept.text
    if stream:
        assert streamed == "" and kept_streamed == kept.text


def test_a_stop_token_with_stop_strings_watched(engine, free):
    """A reply with stop strings (the engine's StopText) that a stop token ends: the token's text is left out too."""
    tok = engine.tokenizer
    k = next(i for i in range(3, 16) if free.token_ids[i] not in free.token_ids[:i] and tok.decode([free.token_ids[i]]))
    got, streamed = _run(engine, "sts", stream=True, stop_token_ids=[free.token_ids[k]], stop=["\x00never"])
    assert got.text == tok.decode(free.token_ids[:k]) == streamed and got.stop_reason == free.token_ids[k]


def _split_character(tok):
    """A character the vocabulary spells in two or more byte tokens, and its token ids."""
    for ch in "🦜🪿🫎🧌𓀀𝔘🜁":
        ids = tok.encode(ch, add_special_tokens=False)
        if len(ids) >= 2 and tok.decode(ids[:1]).endswith("\ufffd"):
            return ch, ids
    pytest.skip("no split character in this vocabulary")


def test_final_decode_leaves_out_a_cut_character(engine):
    tok = engine.tokenizer
    ch, ids = _split_character(tok)
    head = tok.encode("ab", add_special_tokens=False)
    assert final_decode(tok, head + ids) == "ab" + ch
    for k in range(1, len(ids)):
        assert tok.decode(head + ids[:k]).endswith("\ufffd")
        assert final_decode(tok, head + ids[:k]) == "ab"
    spelled = tok.encode("x\ufffd", add_special_tokens=False)  # U+FFFD as a character of its own stays
    assert final_decode(tok, spelled) == "x\ufffd"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_inside_a_character_ends_before_it(engine, stream):
    tok = engine.tokenizer
    _, ids = _split_character(tok)
    got, streamed = _run(engine, f"cut{stream}", stream=stream, max_tokens=1, logit_bias={ids[0]: 100.0})
    assert got.token_ids == ids[:1] and got.finish_reason == "length"
    assert got.text == "" and (not stream or streamed == "")


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    ref, _ = _run(engine, "tr_ref", prompt=PROMPT[-5:], ignore_eos=True, max_tokens=6)
    got, _ = _run(engine, "tr", truncate_prompt_tokens=5, ignore_eos=True, max_tokens=6)
    assert got.prompt_token_ids == PROMPT[-5:] and got.token_ids == ref.token_ids
    whole, _ = _run(engine, "tr_long", truncate_prompt_tokens=50, ignore_eos=True, max_tokens=6)
    assert whole.prompt_token_ids == PROMPT  # shorter than k: as it is
    assert_no_leak(engine)


def test_truncate_prompt_tokens_minus_one_is_max_model_len(tiny_qwen2):
    eng = make_engine(tiny_qwen2, max_model_len=32)
    long = list(range(40, 80))  # 40 tokens > 32
    with pytest.raises(RequestError):
        eng.add_request(StageInput("no", prompt_token_ids=long, sampling_params={"max_tokens": 1}))
    eng.add_request(StageInput("cut", prompt_token_ids=long, sampling_params={"truncate_prompt_tokens": 28,
                                                                              "max_tokens": 2, "temperature": 0.0}))
    out = run_to_completion(eng)["cut"]
    assert out.prompt_token_ids == long[-28:] and out.error is None
    with pytest.raises(RequestError, match="truncate_prompt_tokens: 33 is greater than max_model_len 32") as e:
        eng.add_request(StageInput("big", prompt_token_ids=long, sampling_params={"truncate_prompt_tokens": 33}))
    assert e.value.field == "sampling_params.truncate_prompt_tokens"
    # -1 cuts to max_model_len: then no room is left for a reply, which is refused as for any full prompt
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request(StageInput("m1", prompt_token_ids=long, sampling_params={"truncate_prompt_tokens": -1,
                                                                                 "max_tokens": 1}))
    assert_no_leak(eng)


def test_truncate_prompt_tokens_refuses_to_cut_embeddings_and_spares_downstream_prompts(tiny_qwen2):
    import numpy as np
    eng = make_engine(tiny_qwen2)
    rows = np.zeros((12, eng.model.hidden_size), np.float32)
    with pytest.raises(RequestError, match="cannot be cut") as e:
        eng.add_request(StageInput("emb", prompt_embeds=rows, sampling_params={"truncate_prompt_tokens": 4}))
    assert e.value.field == "sampling_params.truncate_prompt_tokens"
    downstream = make_engine(tiny_qwen2, takes_caller_prompt=False)  # a stage fed by the pipeline
    downstream.add_request(StageInput("d", prompt_token_ids=PROMPT, sampling_params={"truncate_prompt_tokens": 4,
                                                                                     "max_tokens": 1}))
    assert run_to_completion(downstream)["d"].prompt_token_ids == PROMPT


@pytest.mark.parametrize("bad", [0, -2])
def test_truncate_prompt_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=bad)


def test_spaces_between_special_tokens_is_accepted(engine, free):
    for flag in (True, False):
        got, _ = _run(engine, f"sb{flag}", ignore_eos=True, spaces_between_special_tokens=flag)
        assert got.token_ids == free.token_ids and got.text == free.text
    with pytest.raises(ValueError):
        SamplingParams(spaces_between_special_tokens="yes")


@pytest.mark.parametrize("stream", [False, True])
def test_detokenize_false_leaves_the_text_empty(engine, free, stream):
    got, deltas = run_one(engine, f"dt{stream}", PROMPT, stream, temperature=0.0, max_tokens=16, ignore_eos=True,
                          detokenize=False, logprobs=0)
    assert got.token_ids == free.token_ids and got.text == "" and free.text
    assert all(d.text == "" for d in deltas) and (not stream or [t for d in deltas for t in d.token_ids]
                                                  == free.token_ids)
    assert [lp.token for lp in got.logprobs] == [engine.tokenizer.decode([t]) for t in free.token_ids]
    assert_no_leak(engine)


def test_skip_reading_prefix_cache_computes_the_whole_prompt(engine, free):
    skipped, _ = _run(engine, "skip", ignore_eos=True, skip_reading_prefix_cache=True)
    assert skipped.num_cached_tokens == 0 and skipped.token_ids == free.token_ids
    read, _ = _run(engine, "read", ignore_eos=True, skip_reading_prefix_cache=None)
    assert read.num_cached_tokens > 0 and read.token_ids == free.token_ids
    assert_no_leak(engine)
