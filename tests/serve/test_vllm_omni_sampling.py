"""vLLM-Omni's clients' `sampling_params_list` against `omni serve` on the tiny Qwen2.5-Omni (thinker -> talker ->
token2wav): the per-stage entries vLLM-Omni's examples send (examples/online_serving/qwen2_5_omni and qwen3_omni:
the curl scripts, the openai clients, the Gradio demo), written out here as data, their fields and values as
sent, max_tokens lowered to what a tiny model on a CPU answers quickly. Each is accepted and the reply is the one
without the fields that ask for nothing (vLLM's `detokenize`; every vLLM field omni does not implement at its
default); `detokenize: false` on a stage is honoured (no text); a vLLM field asking for what omni does not do is
a 400 naming `sampling_params_list[i].field`.
"""
from __future__ import annotations

import pytest

from tests.serve.server_utils import OMNI, serve_in_process
from tests.test_vllm_sampling import VLLM_DEFAULTS

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory "
          "and visual inputs, as well as generating text and speech.")
QUESTION = "Explain the system architecture for a scalable audio generation pipeline. Answer in 15 words."
MESSAGES = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}}
SHORT = [{"max_tokens": 6}, {"max_tokens": 24}, {}]  # thinker, talker (the code2wav entry's stays as sent)

# thinker, talker, code2wav, as vLLM-Omni's examples send them
QWEN2_5_OMNI = [
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
    {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 2048, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.05, "stop_token_ids": [8294]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
]
QWEN3_OMNI = [
    {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "seed": 42, "repetition_penalty": 1.05,
     "stop_token_ids": [151645]},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
     "repetition_penalty": 1.05, "stop_token_ids": [2150]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
]
QWEN3_OMNI_GRADIO = [{**QWEN3_OMNI[0], "detokenize": True}, *QWEN3_OMNI[1:]]
# what a client serialising a whole vLLM SamplingParams adds: vLLM's fields that ask for nothing here
ASK_NOTHING = {k: v for k, v in VLLM_DEFAULTS.items()
               if k in ("n", "best_of", "output_kind", "skip_clone", "flat_logprobs", "stream_interval", "bad_words",
                        "logits_processors", "allowed_token_ids", "extra_args", "skip_reading_prefix_cache",
                        "thinking_token_budget", "output_text_buffer_length", "prompt_logprob_token_ids",
                        "logprob_token_ids", "trace_decode_token_ids", "repetition_detection", "guided_decoding")}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local") as s:
        yield s


def _short(entries):
    return [{**e, **s} for e, s in zip(entries, SHORT)]


def _reply(server, entries, **kw):
    status, _, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **AUDIO,
                                                           "sampling_params_list": entries, **kw})
    assert status == 200, body
    msg = body["choices"][0]["message"]
    return msg["content"], msg["audio"]["data"]


@pytest.mark.parametrize("entries", [QWEN2_5_OMNI, QWEN3_OMNI, QWEN3_OMNI_GRADIO],
                         ids=["qwen2_5_omni", "qwen3_omni", "qwen3_omni_gradio"])
def test_vllm_omni_example_entries_are_taken(server, entries):
    sent = _short(entries)
    without = [{k: v for k, v in e.items() if k != "detokenize"} for e in sent]
    text, audio = _reply(server, without)
    assert text and audio
    assert _reply(server, sent) == (text, audio)
    assert _reply(server, [{**ASK_NOTHING, **e} for e in sent]) == (text, audio)


def test_detokenize_false_on_the_text_stage_leaves_the_text_empty(server):
    """The thinker's tokens still go to the talker: the same audio, no text."""
    sent = _short(QWEN2_5_OMNI)
    text, audio = _reply(server, sent)
    assert _reply(server, [{**sent[0], "detokenize": False}, *sent[1:]]) == ("", audio) and text


@pytest.mark.parametrize("index,field,value", [
    (0, "n", 2), (1, "output_kind", 1), (2, "best_of", 2), (1, "logits_processors", ["my.module:fn"]),
    (0, "thinking_token_budget", 128), (1, "bad_words", ["x"]), (0, "max_tokens", None),
])
def test_a_vllm_field_asking_for_what_omni_does_not_do_is_refused_by_name(server, index, field, value):
    entries = _short(QWEN2_5_OMNI)
    entries[index] = {**entries[index], field: value}
    status, _, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **AUDIO,
                                                           "sampling_params_list": entries})
    err = body["error"]
    assert status == 400 and err["param"] == f"sampling_params_list[{index}].{field}", body
    assert err["code"] == "unsupported_parameter" and f"{field}: vLLM's" in err["message"], body
