"""The engine side of streaming: per-step deltas out, a prompt that grows in chunks in."""
from __future__ import annotations

import random

import numpy as np
import pytest

from omni.sampling_params import SamplingParams
from omni.messages import StageInput
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _ids(n, seed, vocab=1000):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run_collecting(engine):
    """Run to completion; returns (outputs by id, deltas by id in order)."""
    outs, deltas = {}, {}
    while engine.has_unfinished():
        step = engine.step()
        for d in step.deltas:
            deltas.setdefault(d.request_id, []).append(d)
        for o in step.finished:
            outs[o.request_id] = o
        engine.kv.check_integrity()
    return outs, deltas


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_deltas_concatenate_to_the_final_output(arch, request):
    """Token and text deltas add up to exactly the final tokens and text (random tiny models emit
    plenty of tokens that end in the middle of a multi-byte character)."""
    engine = make_engine(request.getfixturevalue(f"tiny_{arch}"))
    vocab = engine.model.vocab_size
    prompts = [_ids(n, seed, vocab) for seed, n in enumerate((5, 17, 40))]
    for i, p in enumerate(prompts):
        engine.add_request(StageInput(f"s{i}", prompt_token_ids=p, stream=True,
                                      sampling_params=SamplingParams(temperature=0.0, max_tokens=40)))
    engine.add_request(StageInput("quiet", prompt_token_ids=prompts[0], sampling_params=GREEDY))
    outs, deltas = _run_collecting(engine)
    assert "quiet" not in deltas
    multibyte = 0
    for i in range(len(prompts)):
        ds, out = deltas[f"s{i}"], outs[f"s{i}"]
        assert [t for d in ds for t in d.token_ids] == out.token_ids
        assert "".join(d.text for d in ds) == out.text
        assert ds[-1].finished and not any(d.finished for d in ds[:-1])
        counts = [d.num_computed_tokens for d in ds]
        assert counts == sorted(counts) and counts[-1] == len(out.prompt_token_ids) + len(out.token_ids) - 1
        multibyte += any(ord(c) > 127 for c in out.text)
    assert multibyte, "no multi-byte output: the test would not exercise incomplete characters"
    assert_no_leak(engine)


def _chunks(seq, sizes):
    out, i, k = [], 0, 0
    while i < len(seq):
        n = sizes[k % len(sizes)]
        out.append(seq[i:i + n])
        i, k = i + n, k + 1
    return out


@pytest.mark.parametrize("sizes,empty_last", [([1], False), ([3, 5], False), ([4], True), ([7, 2, 9], True)])
def test_growing_prompt_matches_the_whole_prompt(tiny_llama, sizes, empty_last):
    prompt = _ids(29, 3)
    ref = make_engine(tiny_llama)
    ref.add_request(StageInput("r", prompt_token_ids=prompt, sampling_params=GREEDY))
    expected = run_to_completion(ref)["r"]

    engine = make_engine(tiny_llama, block_size=4)
    parts = _chunks(prompt, sizes)
    engine.add_request(StageInput("r", prompt_token_ids=parts[0], sampling_params=GREEDY, input_complete=False))
    engine.add_request(StageInput("other", prompt_token_ids=_ids(9, 4), sampling_params=GREEDY))
    for i, part in enumerate(parts[1:], start=1):
        # Run until the request has computed all it has: it waits without sampling.
        while engine.has_unfinished():
            engine.step()
        req = engine.scheduler.requests["r"]
        assert req.num_computed_tokens == req.num_tokens and not req.output_token_ids
        engine.extend_request("r", part, last=(i == len(parts) - 1 and not empty_last))
    if empty_last:
        while engine.has_unfinished():
            engine.step()
        engine.extend_request("r", [], last=True)
    outs = run_to_completion(engine)
    assert outs["r"].token_ids == expected.token_ids
    assert outs["r"].prompt_token_ids == prompt
    # Pieces vs whole: the same math with steps of different row counts, so the CPU kernels may block
    # their sums differently (1.8e-5 apart on one AVX-512 Xeon): the bound for a 4-layer decoder whose
    # longest sum is 128 terms (intermediate size; hidden 64, at most 40 positions attended).
    atol = decoder_atol(expected.hidden_states, layers=4, widest_sum=128)
    assert_rows_close(outs["r"].hidden_states, expected.hidden_states, atol, "hidden states")
    assert_no_leak(engine)


def test_growing_embeddings_hash_like_the_whole_prompt(tiny_llama):
    """Blocks filled across chunks get the digests of their whole rows: the next turn hits them."""
    rng = np.random.default_rng(0)
    engine = make_engine(tiny_llama, block_size=4)
    width = engine.model.hidden_size
    rows = rng.standard_normal((22, width)).astype(np.float32)
    first = 5
    engine.add_request(StageInput("g", prompt_token_ids=[0] * first, prompt_embeds=rows[:first],
                                  sampling_params=GREEDY, input_complete=False))
    for lo, hi in ((5, 6), (6, 13), (13, 22)):
        engine.step()
        engine.extend_request("g", [0] * (hi - lo), rows[lo:hi], last=hi == 22)
    grown_hashes = list(engine.scheduler.requests["g"].block_hashes)
    grown = run_to_completion(engine)["g"]

    whole = make_engine(tiny_llama, block_size=4)
    whole.add_request(StageInput("w", prompt_token_ids=[0] * 22, prompt_embeds=rows, sampling_params=GREEDY))
    assert list(whole.scheduler.requests["w"].block_hashes) == grown_hashes[:len(grown_hashes)]
    assert run_to_completion(whole)["w"].token_ids == grown.token_ids
    # A follow-up with the same leading rows hits the grown request's blocks.
    longer = np.concatenate([rows, rng.standard_normal((3, width)).astype(np.float32)])
    engine.add_request(StageInput("t2", prompt_token_ids=[0] * 25, prompt_embeds=longer, sampling_params=GREEDY))
    assert run_to_completion(engine)["t2"].num_cached_tokens == 20
    assert_no_leak(engine)


def test_waiting_request_blocks_nobody_and_aborts_cleanly(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(StageInput("w", prompt_token_ids=_ids(6, 1), sampling_params=GREEDY, input_complete=False))
    engine.add_request(StageInput("x", prompt_token_ids=_ids(6, 2), sampling_params=GREEDY))
    outs = run_to_completion(engine)  # returns: the waiting request is not work
    assert set(outs) == {"x"} and "w" in engine.scheduler.requests
    assert engine.kv.usage > 0
    engine.abort("w")
    engine.step()
    assert_no_leak(engine)


def test_extend_errors_name_the_field_and_leave_the_request_alone(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=40)
    vocab = engine.model.vocab_size
    engine.add_request(StageInput("g", prompt_token_ids=_ids(5, 1), sampling_params=GREEDY, input_complete=False))
    engine.add_request(StageInput("done", prompt_token_ids=_ids(5, 2), sampling_params=GREEDY))
    cases = [
        (("nope", [1]), "request_id"),
        (("done", [1]), "request_id"),
        (("g", [vocab]), "prompt_token_ids"),
        (("g", [1] * 30), "max_model_len"),
    ]
    for (rid, ids), field in cases:
        with pytest.raises(ValueError, match=field):
            engine.extend_request(rid, ids)
    with pytest.raises(ValueError, match="prompt_embeds"):
        engine.extend_request("g", [0], np.zeros((1, engine.model.hidden_size), np.float32))
    assert engine.scheduler.requests["g"].num_prompt_tokens == 5
    engine.extend_request("g", [7, 8], last=True)
    outs = run_to_completion(engine)
    assert len(outs["g"].prompt_token_ids) == 7
    assert_no_leak(engine)


def test_read_rows_of_a_running_request(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = _ids(11, 5)
    engine.add_request(StageInput("r", prompt_token_ids=prompt, sampling_params=GREEDY, stream=True,
                                  return_hidden_states=True))
    engine.step()
    rows = engine.read_rows("r", 2, 9)["hidden_states"]
    with pytest.raises(ValueError, match="only"):
        engine.read_rows("r", 0, 50)
    out = run_to_completion(engine)["r"]
    # The same rows of the same tensor cache, read before and after the request finished: no math in
    # between, so they must be bitwise equal.
    np.testing.assert_array_equal(rows, out.hidden_states[2:9])
    with pytest.raises(ValueError, match="not running"):
        engine.read_rows("r", 0, 1)
    assert_no_leak(engine)
