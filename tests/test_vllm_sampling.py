"""Every field of vLLM's SamplingParams (vllm/sampling_params.py: main, and the earlier fields vLLM-Omni's pinned
vLLM versions still have), on omni's SamplingParams, the Python API and a config's `sampling:`:

- at vLLM's default each is accepted, and asks for nothing: all of them together are omni's defaults;
- a field omni implements is honoured (the engine tests: tests/engine/test_vllm_text_fields.py);
- a field omni does not implement, at any other value, is refused by name (code unsupported_parameter) with what
  to do instead.
"""
from __future__ import annotations

import enum

import pytest
from pydantic import ValidationError

from omni import Omni
from omni.config.loader import load_config
from omni.errors import ConfigError, RequestError
from omni.sampling_params import SamplingParams, resolve_sampling_params
from tests.fakes import chain_config, fake_factory

# vLLM's fields at their defaults, as a client serialising a vLLM SamplingParams (msgspec: enums as numbers) or
# writing every field out sends them
VLLM_DEFAULTS = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False,
    "max_tokens": 16, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None, "logprob_token_ids": None, "flat_logprobs": False, "detokenize": True,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "output_kind": 0, "stream_interval": None, "skip_clone": False, "output_text_buffer_length": 0,
    "structured_outputs": None, "logit_bias": None, "allowed_token_ids": None, "extra_args": None, "bad_words": None,
    "skip_reading_prefix_cache": None, "thinking_token_budget": None, "repetition_detection": None,
    "routed_experts_prompt_start": 0, "trace_decode_token_ids": None,
    # earlier vLLM versions'
    "best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "guided_decoding": None, "logits_processors": None, "truncate_prompt_tokens": None,
}

# a value of each unimplemented field that asks for something, and a word of what the refusal says to do
UNSUPPORTED = [
    ("n", 2, "submit the prompt n times"), ("best_of", 3, "keep the best"), ("use_beam_search", True, "beam"),
    ("length_penalty", 0.5, "beam"), ("early_stopping", True, "beam"), ("guided_decoding", {"json": {}},
                                                                         "structured_outputs"),
    ("logits_processors", ["m.f"], "logit_bias"), ("allowed_token_ids", [1, 2], "structured_outputs"),
    ("bad_words", ["x"], "logit_bias"), ("logprob_token_ids", [5], "logprobs"),
    ("prompt_logprob_token_ids", [5], "prompt_logprobs"), ("prompt_logprob_start", 3, "prompt_logprobs"),
    ("flat_logprobs", True, "TokenLogprob"), ("output_kind", 1, "stream()"), ("output_kind", "FINAL_ONLY", "stream()"),
    ("stream_interval", 4, "each step"), ("output_text_buffer_length", 2, "internal"),
    ("thinking_token_budget", 64, "max_tokens"), ("repetition_detection", {"max_pattern_size": 4, "min_count": 3},
                                                  "repetition_penalty"),
    ("routed_experts_prompt_start", 5, "routed experts"), ("trace_decode_token_ids", [1, 2], "forced_token_ids"),
    ("max_tokens", None, "max_tokens_fit"),
]


def test_vllms_defaults_are_omnis_defaults():
    assert SamplingParams(**VLLM_DEFAULTS) == SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert SamplingParams(**{name: value}) == SamplingParams(), name


@pytest.mark.parametrize("name,value,hint", UNSUPPORTED)
def test_an_unimplemented_field_asking_for_something_is_refused_by_name(name, value, hint):
    with pytest.raises(RequestError) as e:
        resolve_sampling_params({name: value}, SamplingParams(), "thinker")
    assert e.value.field == f"sampling_params.{name}" and e.value.code == "unsupported_parameter"
    assert f"{name}: vLLM's" in e.value.message and hint in e.value.message


def test_vllm_spellings_of_the_defaults():
    """RequestOutputKind.CUMULATIVE as an enum or its name; skip_clone either way (a permission, nothing to do);
    vLLM's -1 thinking budget (unlimited) and a best_of equal to n; `false` is not 0."""
    Kind = enum.Enum("RequestOutputKind", {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2})
    for same in ({"output_kind": Kind.CUMULATIVE}, {"output_kind": "CUMULATIVE"}, {"skip_clone": True},
                 {"thinking_token_budget": -1}, {"best_of": 1}, {"bad_words": []}, {"stream_interval": 1},
                 {"length_penalty": 1}, {"skip_reading_prefix_cache": False}):
        assert SamplingParams(**same) == SamplingParams(), same
    for bad in ({"output_kind": Kind.DELTA}, {"output_kind": False}, {"n": True}, {"skip_clone": "yes"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_the_vllm_fields_omni_implements_are_kept():
    sp = SamplingParams(detokenize=False, skip_reading_prefix_cache=True, extra_args={"plugin": {"k": 1}})
    assert sp.detokenize is False and sp.skip_reading_prefix_cache is True and sp.extra_args == {"plugin": {"k": 1}}
    with pytest.raises(ValidationError, match="detokenize"):
        SamplingParams(detokenize=0)
    # vLLM's rule: stop strings are found in the text
    with pytest.raises(RequestError) as e:
        resolve_sampling_params({"stop": ["."], "detokenize": False}, SamplingParams(), "thinker")
    assert e.value.field == "sampling_params.stop" and "detokenize" in e.value.message
    assert SamplingParams(stop_token_ids=[7], detokenize=False).stop_token_ids == [7]


def test_the_python_api_takes_vllm_fields():
    """Omni.generate: a dict of vLLM's fields for every stage, per stage, or a list (vLLM-Omni's
    sampling_params_list); a field asking for what omni does not do is refused naming it."""
    vllm = {"temperature": 0.0, "top_k": -1, "seed": 42, "detokenize": True, "n": 1, "skip_clone": True}
    with Omni(chain_config(), engine_factory=fake_factory) as o:
        plain = o.generate("hi", {"temperature": 0.0, "top_k": -1, "seed": 42}, use_tqdm=False)[0]
        for sp in (vllm, {"thinker": vllm, "talker": {**vllm, "detokenize": False}}, [vllm, vllm]):
            out = o.generate("hi", sp, use_tqdm=False)[0]
            assert {s: r.token_ids for s, r in out.outputs.items()} == {
                s: r.token_ids for s, r in plain.outputs.items()}
        with pytest.raises(RequestError) as e:
            o.generate("hi", {"talker": {"detokenize": False, "output_kind": 2}}, use_tqdm=False)
    assert e.value.field == "sampling_params.output_kind" and e.value.stage == "talker"


def test_a_configs_sampling_takes_vllm_fields():
    def cfg(sampling):
        return {"name": "t", "runtime": {"backend": "local"},
                "stages": [{"name": "a", "model": "fake", "model_path": "unused", "final_output": "text",
                            "sampling": sampling}]}

    sampling = load_config(cfg({"temperature": 0.9, "detokenize": False, "n": 1, "output_kind": 0,
                                "stop_token_ids": None})).stages[0].sampling
    assert sampling.detokenize is False and sampling.temperature == 0.9 and sampling.stop_token_ids == []
    with pytest.raises(ConfigError, match=r"stage 'a': sampling: n: vLLM's n is not supported"):
        load_config(cfg({"n": 4}))
