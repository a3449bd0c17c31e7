"""Structured outputs (SamplingParams.structured_outputs, omni/engine/io/structured_output.py): every reply follows its
grammar whatever the model prefers, the request ends when the grammar is complete, the other rows of a batch are
untouched, and what cannot be compiled is refused naming the field."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from omni.errors import RequestError
from omni.engine.runner.sampler import apply_bitmask
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, generate, make_engine, run_to_completion

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def _prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_apply_bitmask_keeps_exactly_the_set_bits():
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 1] = 1 << 1  # token 33
    mask[1] = -1  # everything
    out = apply_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 33]
    assert torch.isfinite(out[1]).all() and torch.equal(logits, torch.zeros(2, 40))  # a copy


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_grammar_that_spells_out_an_added_token_is_followed(tiny_qwen2, seed):
    """Qwen's `<tool_call>` is an added token that is not special (the model writes it as text): a constraint that
    spells it out (a Hermes call, say) is followed whether the model writes it with that token or piece by piece."""
    engine = make_engine(tiny_qwen2)
    tok = engine.tokenizer
    call = '<tool_call>\n{"name": "f"}\n</tool_call>'
    engine.add_request(StageInput("r", prompt_token_ids=_prompt(seed), sampling_params=SamplingParams(
        temperature=1.0, seed=seed, max_tokens=40, structured_outputs={"regex": "(ok )?" + re.escape(call)})))
    out = run_to_completion(engine)["r"]
    assert re.fullmatch("(ok )?" + re.escape(call), tok.decode(out.token_ids)) and out.finish_reason == "stop"
    assert_no_leak(engine)


@pytest.mark.slow
def test_constrained_replies_follow_their_grammar_in_a_mixed_batch(tiny_qwen2):
    engine = make_engine(tiny_qwen2, caching=True)
    tok = engine.tokenizer
    (alone,) = generate(engine, [_prompt(9)], prefix="alone", max_tokens=8, ignore_eos=True)
    specs = {"j": {"json": SCHEMA}, "r": {"regex": "[a-f]{2}[0-9]{2}"}, "c": {"choice": ["north", "south"]}}
    for seed in range(3):
        for key, spec in specs.items():
            engine.add_request(StageInput(f"{key}{seed}", prompt_token_ids=_prompt(seed), sampling_params=SamplingParams(
                temperature=1.0, seed=seed, max_tokens=40, structured_outputs=spec)))
        # an unconstrained request in the same batches: the masks are per row
        engine.add_request(StageInput(f"free{seed}", prompt_token_ids=_prompt(9), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True)))
        outs = run_to_completion(engine)
        value = json.loads(tok.decode(outs[f"j{seed}"].token_ids))
        assert set(value) == {"name", "age"} and value["name"] in ("ada", "bob") and 0 <= value["age"] <= 99
        assert re.fullmatch("[a-f]{2}[0-9]{2}", tok.decode(outs[f"r{seed}"].token_ids))
        assert tok.decode(outs[f"c{seed}"].token_ids) in ("north", "south")
        for key in specs:  # ended by the grammar, not by max_tokens
            assert outs[f"{key}{seed}"].finish_reason == "stop" and len(outs[f"{key}{seed}"].token_ids) < 40
        assert outs[f"free{seed}"].token_ids == alone.token_ids
    assert_no_leak(engine)


@pytest.mark.slow
def test_what_cannot_be_compiled_is_refused_naming_the_field(tiny_qwen2):
    engine = make_engine(tiny_qwen2)
    for spec, says in (({"json": {"type": "objekt"}}, "objekt"), ({"regex": "(unclosed"}, "regex")):
        with pytest.raises(RequestError) as e:
            engine.add_request(StageInput("bad", prompt_token_ids=_prompt(1), sampling_params=SamplingParams(
                max_tokens=4, structured_outputs=spec)))
        assert e.value.field == "sampling_params.structured_outputs" and says in str(e.value)
    (ok,) = generate(engine, [_prompt(1)], max_tokens=2)  # the stage serves on
    assert len(ok.token_ids) == 2
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="cannot be combined with min_tokens"):
        SamplingParams(structured_outputs={"regex": "a"}, min_tokens=1, max_tokens=4)
    assert_no_leak(engine)


@pytest.mark.slow
@pytest.mark.real_weights
def test_smollm2_answers_in_the_schema(smollm2):
    """A real model (SmolLM2-135M, its own byte-level BPE vocabulary) asked for the capital of France: free, it
    writes JSON-ish prose past max_tokens; constrained, a compact object with the schema's keys, ended by the
    grammar, and its greedy city is still Paris."""
    engine = make_engine(smollm2, num_blocks=512, block_size=16, use_chat_template=True)
    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Give me the capital of France as JSON with "
                                       "city and country."}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"]) if hasattr(prompt, "keys") else list(prompt)
    engine.add_request(StageInput("json", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs={"json": schema})))
    out = run_to_completion(engine)["json"]
    value = json.loads(tok.decode(out.token_ids))
    assert set(value) == {"city", "country"} and value["city"] == "Paris" and out.finish_reason == "stop"
    assert_no_leak(engine)
