"""tool_choice "auto" on a server started as vLLM's users start theirs (`--enable-auto-tool-choice
--tool-call-parser hermes`), with the real `openai` client. The tiny chain's random thinker says what it is told
(its reply forced through omni's `sampling_params_list[0].forced_text`, the speech endpoint's mechanism): a Hermes
tool call or plain text, and the server must turn the one into `tool_calls` and leave the other text, streamed or
not."""
from __future__ import annotations

import json

import pydantic
import pytest

from omni.serve.settings import ServeSettings
from tests.serve.server_utils import CHAIN, serve_in_process

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny_chain"
HELLO = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}}}}}
CALL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>'
TEXT_REPLY = "It will be sunny."


def _told(reply: str) -> dict:
    return {"sampling_params_list": [{"forced_text": reply}, {}]}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local", "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.mark.parametrize("choice", ["auto", None])  # None: the default with tools, as the openai client sends it
def test_a_call_in_the_reply_comes_back_as_tool_calls(client, choice):
    kw = {} if choice is None else {"tool_choice": choice}
    got = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=80,
                                         extra_body=_told(CALL_REPLY), **kw)
    choice0 = got.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content == "Checking.\n"
    [call] = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"unit": "c", "days": 2}


def test_streamed_the_content_comes_first_then_the_call(client):
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=80,
                                                extra_body=_told(CALL_REPLY), stream=True):
        for c in chunk.choices:
            assert not (c.delta.content and "<tool_call>" in c.delta.content)  # the markup is never text
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "Checking.\n" and finish == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"unit": "c", "days": 2}


def test_a_text_reply_stays_text(client):
    got = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=40,
                                         extra_body=_told(TEXT_REPLY))
    assert got.choices[0].message.content == TEXT_REPLY and got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(c.delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=40, extra_body=_told(TEXT_REPLY), stream=True)
        for c in chunk.choices)
    assert streamed == TEXT_REPLY


def test_a_malformed_call_is_shown_as_text(client):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"\n</tool_call>'
    got = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=80,
                                         extra_body=_told(broken))
    assert got.choices[0].message.content == broken and got.choices[0].message.tool_calls is None


def test_the_flag_needs_a_parser():
    with pytest.raises(pydantic.ValidationError, match="--tool-call-parser"):
        ServeSettings(enable_auto_tool_choice=True)
