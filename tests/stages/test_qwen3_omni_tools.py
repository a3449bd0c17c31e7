"""Tools on the Qwen3-Omni thinker: its own prompt renderer writes tools, tool calls and tool results in Qwen3's
function-calling format, checked here against that format as Qwen3's Jinja chat template writes it, rendered by
transformers' own chat-template machinery (its `tojson` filter included) on the tiny checkpoint's tokenizer."""
from __future__ import annotations

import pytest

from stages.qwen3_omni.inputs import render_chatml

# Qwen3's chat template, the parts a non-thinking conversation with tools goes through (the reasoning parts of
# the original drop out for assistant turns without <think>).
QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Le temps qu'il fait, °C.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "Weather in Zürich for 2 days, and the time?"}
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Zürich", "days": 2}}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
CONVERSATIONS = {
    "first turn": [ASK],
    "with a system turn": [{"role": "system", "content": "Be brief."}, ASK],
    "calls then results": [ASK, {"role": "assistant", "content": None, "tool_calls": CALLS},
                           {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 °C"},
                           {"role": "tool", "tool_call_id": "call_2", "content": "12:30"},
                           {"role": "assistant", "content": "Sunny and 21 °C; it is 12:30."},
                           {"role": "user", "content": "And tomorrow?"}],
    "text before a call": [{"role": "system", "content": "Be brief."}, ASK,
                           {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS[:1]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}],
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.stages.qwen3_omni_utils import checkpoint

    return AutoTokenizer.from_pretrained(str(checkpoint("tiny")))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("tools", [[WEATHER, TIME], None], ids=["tools", "no tools"])
def test_the_prompt_is_qwen3s_function_calling_format(tokenizer, name, tools):
    messages = CONVERSATIONS[name]
    want = tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN3_TOOLS_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert render_chatml(messages, None, tools) == want


def test_the_hermes_parser_reads_back_the_calls_the_format_writes():
    """A reply in the format the prompt asks for is what `--tool-call-parser hermes` turns into tool_calls."""
    import json

    from omni.serve.generation.tool_parser import parse_tool_calls

    prompt = render_chatml([ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS}], None,
                           [WEATHER, TIME])
    reply = prompt[prompt.rindex("<|im_start|>assistant\nLet me look.") + len("<|im_start|>assistant\n"):]
    reply = reply[: reply.index("<|im_end|>")]
    content, calls = parse_tool_calls(reply)
    assert content == "Let me look.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {})]


def test_both_omni_renderers_name_a_part_they_cannot_take_and_leave_empty_content_empty():
    from omni.errors import RequestError
    from stages.qwen2_5_omni.inputs import render_chat

    video = [{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "hologram"}]}]
    for render, model in ((lambda m: render_chatml(m, None), "Qwen3-Omni"), (lambda m: render_chat(m, "S"),
                                                                              "Qwen2.5-Omni")):
        with pytest.raises(RequestError, match=rf"prompt\[1\]\.content\[0\]\.type: the {model} thinker") as e:
            render(video)
        assert e.value.field == "prompt[1].content[0].type"
        calls_only = render([ASK, {"role": "assistant", "content": None}])
        assert "None" not in calls_only and "<|im_start|>assistant\n<|im_end|>" in calls_only
