"""Tools reach the text stage's chat template (omni.prompts.tokenize_prompt, which the engine and the router
both call), from the Python API's prompt dicts too; a raw text prompt, which no template renders, refuses them."""
from __future__ import annotations

import pytest

from omni.errors import RequestError
from omni.prompts import to_stage_input, tokenize_prompt

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
            "{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
            "({{ c.function.arguments.city }}){% endfor %}{{ m.content or '' }}\n{% endfor %}assistant:")


@pytest.fixture
def tokenizer(tiny_qwen2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen2))  # the session's one (conftest's TokenizerCache): put back
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    yield tok
    tok.chat_template = saved


def test_tools_and_calls_are_rendered_by_the_template(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = tokenize_prompt(tokenizer, messages, False, "s")
    with_tools = tokenize_prompt(tokenizer, messages, False, "s", [TOOL])
    assert tokenizer.decode(with_tools).startswith("TOOLS:get_weather;") and tokenizer.decode(plain).startswith("user:")
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    assert "CALL get_weather(Paris)" in tokenizer.decode(tokenize_prompt(tokenizer, turn, False, "s", [TOOL]))


def test_a_raw_prompt_refuses_tools_and_prompt_dicts_carry_them(tokenizer):
    with pytest.raises(RequestError) as e:
        tokenize_prompt(tokenizer, "Weather in Paris?", False, "s", [TOOL])
    assert e.value.field == "tools"
    inp = to_stage_input({"prompt": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, "prompts[0]", lambda: "r")
    assert inp.tools == [TOOL]
    with pytest.raises(RequestError) as e:
        to_stage_input({"prompt": "hi", "tools": "get_weather"}, "prompts[0]", lambda: "r")
    assert e.value.field == "tools"


def test_chat_template_kwargs_are_the_templates_variables(tokenizer):
    """vLLM's chat_template_kwargs: variables the template reads (Qwen3's enable_thinking); one it does not read
    changes nothing; the template call's own arguments are refused by name. From the Python API's dicts too."""
    tokenizer.chat_template = TEMPLATE + "{% if think %} <think>{% endif %}"
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenize_prompt(tokenizer, messages, False, "s")
    assert tokenize_prompt(tokenizer, messages, False, "s", template_kwargs={"unused": 1}) == plain
    thinking = tokenize_prompt(tokenizer, messages, False, "s", template_kwargs={"think": True})
    assert tokenizer.decode(thinking) == tokenizer.decode(plain) + " <think>"
    with pytest.raises(RequestError) as e:
        tokenize_prompt(tokenizer, messages, False, "s", template_kwargs={"tokenize": False})
    assert e.value.field == "chat_template_kwargs.tokenize"
    inp = to_stage_input({"prompt": messages, "chat_template_kwargs": {"think": True}}, "prompts[0]", lambda: "r")
    assert inp.chat_template_kwargs == {"think": True}
    with pytest.raises(RequestError, match="chat_template_kwargs"):
        to_stage_input({"prompt": messages, "chat_template_kwargs": ["think"]}, "prompts[0]", lambda: "r")
