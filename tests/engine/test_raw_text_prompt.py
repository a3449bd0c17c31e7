"""StageInput.chat_template=False: a text prompt is the model's input as it is, even on a stage with
`use_chat_template` (the completions endpoint's prompt, as vLLM's completions never apply a template)."""
from __future__ import annotations

from omni.messages import StageInput
from omni.serve.protocol.completions import CompletionRequest
from omni.serve.chat.jobs import completion_jobs
from tests.engine_utils import make_engine, run_to_completion


def test_a_raw_text_prompt_skips_the_stages_chat_template(tiny_qwen2):
    engine = make_engine(tiny_qwen2, use_chat_template=True)
    tok = engine.tokenizer
    text = "List the days of the week: Monday, Tuesday,"
    engine.add_request(StageInput("raw", prompt=text, chat_template=False, sampling_params={"max_tokens": 2}))
    engine.add_request(StageInput("chat", prompt=text, sampling_params={"max_tokens": 2}))
    outs = run_to_completion(engine)
    assert outs["raw"].prompt_token_ids == list(tok(text, add_special_tokens=True)["input_ids"])
    templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    templated = list(templated["input_ids"]) if hasattr(templated, "keys") else list(templated)
    assert outs["chat"].prompt_token_ids == templated != outs["raw"].prompt_token_ids


def test_completions_send_text_prompts_raw():
    from omni.serve.state import PipelineInfo

    info = PipelineInfo("m", ["thinker"], "thinker", "thinker", None)
    texts = CompletionRequest.model_validate({"model": "m", "prompt": ["Hello", "Hi"], "max_tokens": 2})
    assert [(j.prompt.prompt, j.prompt.chat_template) for j in completion_jobs(texts, info, "c-1")] == [
        ("Hello", False), ("Hi", False)]
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    [job] = completion_jobs(ids, info, "c-2")
    assert job.prompt.prompt_token_ids == [1, 2, 3]
