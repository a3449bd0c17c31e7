"""Forced replies (SamplingParams.forced_token_ids / forced_text): the stage prefills prompt + reply in
one pass, its rows and KV are those of generating that reply, and nothing sampled reaches the output."""
from __future__ import annotations

import random

import pytest

from omni.errors import ContextLengthError, RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from stages.checkpoints.tiny_lm import TINY_ARCHS
from tests.engine_utils import assert_no_leak, generate, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _forced(engine, rid: str, prompt: list[int], reply: list[int], **kw):
    engine.add_request(StageInput(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, forced_token_ids=reply, **kw)))


def test_forced_reply_is_what_generating_it_computes(tiny_llama):
    """Forcing the reply greedy decoding produced gives its tokens and (within fp32 blocking) its rows,
    in one step where generating took one per token."""
    engine = make_engine(tiny_llama, caching=False)
    prompt = _ids(21, 0, engine.model.vocab_size)
    (gen,) = generate(engine, [prompt], max_tokens=9, ignore_eos=True)
    steps_before = engine.stats().steps
    _forced(engine, "f", prompt, list(gen.token_ids))
    out = run_to_completion(engine)["f"]
    assert engine.stats().steps - steps_before == 1
    assert out.token_ids == gen.token_ids and out.prompt_token_ids == prompt
    assert out.finish_reason == "stop"
    assert out.hidden_states.shape == gen.hidden_states.shape == (len(prompt) + 8, engine.model.hidden_size)
    atol = decoder_atol(gen.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
    assert_rows_close(out.hidden_states, gen.hidden_states, atol, "forced vs generated rows")
    assert_no_leak(engine)


def test_forced_reply_ignores_what_the_model_would_say(tiny_llama):
    """A reply the model would never produce (ids it does not sample, an eos mid-reply, longer than
    max_tokens) comes out exactly; its rows are the plain prefill of prompt + reply[:-1]."""
    engine = make_engine(tiny_llama, caching=False)
    vocab = engine.model.vocab_size
    prompt = _ids(13, 1, vocab)
    eos = engine.model.eos_token_id
    reply = _ids(5, 2, vocab) + [eos] + _ids(6, 3, vocab)
    _forced(engine, "f", prompt, reply, max_tokens=2)
    out = run_to_completion(engine)["f"]
    assert out.token_ids == reply
    (plain,) = generate(engine, [prompt + reply[:-1]], prefix="p", max_tokens=1)
    atol = decoder_atol(plain.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
    assert_rows_close(out.hidden_states, plain.hidden_states, atol, "forced rows vs prefill rows")
    assert_no_leak(engine)


def test_forced_reply_streams_its_tokens_as_their_rows_are_computed(tiny_llama):
    """Chunked prefill: each delta carries the reply tokens whose preceding row is computed; the deltas
    concatenate to the reply, and every delta's tokens have rows (a streaming edge reads them)."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=8)
    vocab = engine.model.vocab_size
    prompt, reply = _ids(10, 4, vocab), _ids(15, 5, vocab)
    engine.add_request(StageInput("s", prompt_token_ids=prompt, stream=True, sampling_params=SamplingParams(
        temperature=0.0, forced_token_ids=reply)))
    deltas, out = [], None
    while engine.has_unfinished():
        step = engine.step()
        deltas += step.deltas
        out = next((o for o in step.finished), out)
    assert [t for d in deltas for t in d.token_ids] == reply == out.token_ids
    sent = 0
    for d in deltas:
        sent += len(d.token_ids)
        assert sent <= max(0, d.num_computed_tokens - len(prompt) + 1)
    assert len(deltas) > 2  # the 24-token pass took several chunks of 8
    assert_no_leak(engine)


def test_forced_reply_is_cached_like_a_generated_one(tiny_llama):
    """The next turn (prompt + reply + more) hits the blocks the forced reply filled."""
    engine = make_engine(tiny_llama, block_size=4)
    vocab = engine.model.vocab_size
    prompt, reply = _ids(12, 6, vocab), _ids(9, 7, vocab)
    _forced(engine, "t1", prompt, reply)
    run_to_completion(engine)
    (turn2,) = generate(engine, [prompt + reply + _ids(5, 8, vocab)], prefix="t2", max_tokens=2)
    # 21 tokens, 20 computed (the reply's last token never is, as a generated one): 5 full blocks of 4
    assert turn2.num_cached_tokens == 20
    assert_no_leak(engine)


def test_forced_text_is_tokenized_and_ends_with_eos(tiny_qwen2):
    engine = make_engine(tiny_qwen2)
    engine.add_request(StageInput("t", prompt="Say it:", sampling_params=SamplingParams(
        temperature=0.0, forced_text="Hello there, world")))
    out = run_to_completion(engine)["t"]
    tok = engine.tokenizer
    assert out.token_ids == tok.encode("Hello there, world", add_special_tokens=False) + [engine.model.eos_token_id]
    assert out.text == "Hello there, world"
    assert_no_leak(engine)


def test_forced_reply_refusals_name_the_field(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    vocab = engine.model.vocab_size
    with pytest.raises(RequestError) as e:
        _forced(engine, "v", [5, 6], [7, vocab + 3])
    assert e.value.field == "sampling_params.forced_token_ids" and e.value.actual == vocab + 3
    with pytest.raises(ContextLengthError) as e:
        _forced(engine, "l", _ids(40, 9, vocab), _ids(30, 10, vocab), max_tokens=30)
    assert e.value.actual == 70 and e.value.limit == 64
    # The reply's tokens are what asked for the room: the error names them, not a max_tokens (here it happens to
    # be 30 as well; a caller who sent forced_text never sent one at all).
    assert e.value.field == "sampling_params.forced_token_ids"
    assert e.value.message == ("prompt: 40 tokens + a forced reply of 30 tokens = 70 exceed max_model_len 64 of stage "
                               f"{engine.name!r}; shorten the prompt or the forced reply")
    with pytest.raises(RequestError, match="still streams in") as e:
        engine.add_request(StageInput("g", prompt_token_ids=[5, 6], input_complete=False,
                                      sampling_params=SamplingParams(forced_token_ids=[7, 8])))
    assert e.value.field == "sampling_params.forced_token_ids"
    with pytest.raises(ValueError, match="forced_token_ids must be a non-empty"):
        SamplingParams(forced_token_ids=[])
    with pytest.raises(ValueError, match="send one of them"):
        SamplingParams(forced_token_ids=[3], forced_text="x")
    assert not engine.scheduler.requests
    assert_no_leak(engine)
