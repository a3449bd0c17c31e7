"""400s for values a union field (`stop`, `prompt`, `tool_choice`) or a typed object (`tools[i]`) does not take:
`param` names the field as the user wrote it, never a pydantic union member (`stop.str`, `prompt.str`,
`tool_choice.NamedToolChoice.allowed_tools`), and the message says what the field takes."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from omni.serve.protocol.parse import parse_request
from omni.config.pydantic_errors import accepts, loc_to_param
from omni.serve.http.errors import ApiError, from_validation_error
from omni.serve.protocol.chat import ChatCompletionRequest, PART_TAGS
from omni.serve.protocol.completions import CompletionRequest

MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def chat_error(**extra: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps({"model": "m", "messages": MESSAGES, **extra}).encode())
    assert e.value.status == 400 and set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    return e.value


def completion_error(**extra: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(CompletionRequest, json.dumps({"model": "m", **extra}).encode())
    assert e.value.status == 400
    return e.value


# --------------------------------------------------------------- the QA cases
def test_stop_of_the_wrong_type_names_stop_and_what_it_takes():
    e = chat_error(stop=5)
    assert e.param == "stop" and e.code == "invalid_value", e.body()
    assert e.message == "stop: expected a string or a list of up to 16 strings (got 5)"
    for bad in ({"a": 1}, True, 1.5):
        assert chat_error(stop=bad).param == "stop"


def test_a_batch_of_prompts_is_taken_and_a_bad_prompt_of_it_named():
    """completions' batches (strings, or token-id lists) are prompts of their own; a list of one is that prompt, a
    list of ids one prompt; a bad prompt of a batch is refused naming it (and the token id: `prompt[1][0]`)."""
    def prompts(p):
        return parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": p}).encode()).prompts

    assert prompts([[1, 2, 3], [4, 5]]) == [[1, 2, 3], [4, 5]] and prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1, 2, 3]]) == prompts([1, 2, 3]) == [[1, 2, 3]] and prompts(["a"]) == prompts("a") == ["a"]
    for bad, param in ((["a", ""], "prompt[1]"), (["a", [1]], "prompt[1]"), ([[1], ["a"]], "prompt[1][0]"),
                       ([[1, "a"]], "prompt[0][1]"), ([1, "a"], "prompt[1]"), ([[1], []], "prompt[1]"),
                       ([{"a": 1}], "prompt[0]"), ([True], "prompt[0]"), ([], "prompt")):
        e = completion_error(prompt=bad)
        assert (e.param, e.code) == (param, "invalid_value"), (bad, e.body())
    for bad in (5, {"a": 1}):
        e = completion_error(prompt=bad)
        assert e.param == "prompt" and "a batch of prompts" in e.message, e.body()


def test_an_unsupported_tool_choice_names_tool_choice_and_what_is_supported():
    e = chat_error(tools=TOOLS, tool_choice={"type": "allowed_tools",
                                             "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                                          "function": {"name": "f"}}]}})
    assert (e.param, e.code) == ("tool_choice", "invalid_value"), e.body()
    assert '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}' in e.message
    assert 'got an object of type "allowed_tools"' in e.message
    e = chat_error(tools=TOOLS, tool_choice="sometimes")
    assert e.param == "tool_choice" and '"required"' in e.message and '(got "sometimes")' in e.message


def test_a_named_tool_choice_keeps_its_own_field_errors():
    """A value shaped like one member of the union (an object of type function) gets that member's error."""
    e = chat_error(tools=TOOLS, tool_choice={"type": "function", "function": {"name": ""}})
    assert e.param == "tool_choice.function.name", e.body()
    e = chat_error(tools=TOOLS, tool_choice={"type": "function"})
    assert (e.param, e.code) == ("tool_choice.function", "missing_required_parameter"), e.body()
    e = chat_error(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}, "x": 1})
    assert (e.param, e.code) == ("tool_choice.x", "unknown_parameter"), e.body()
    e = chat_error(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    assert e.param == "tool_choice.function.name" and "'g' is not one of the tools" in e.message


def test_a_custom_tool_is_refused_by_its_type():
    e = chat_error(tools=[{"type": "custom", "custom": {"name": "x"}}])
    assert (e.param, e.code) == ("tools[0].type", "invalid_value"), e.body()
    assert 'type "custom" is not supported (only "function")' in e.message
    e = chat_error(tools=[*TOOLS, {"type": "custom", "custom": {"name": "x"}}])
    assert e.param == "tools[1].type", e.body()


def test_a_list_shaped_stop_names_its_bad_item():
    e = chat_error(stop=["a", 3])
    assert e.param == "stop[1]" and "valid string" in e.message, e.body()


# ------------------------------------------------------------ non-union errors as before
@pytest.mark.parametrize("extra,param,code,fragment", [
    ({"temperature": -1}, "temperature", "invalid_value", "temperature: Input should be greater than or equal to 0"),
    ({"temperature": "hot"}, "temperature", "invalid_value", "temperature:"),
    ({"stop": ["a"] * 17}, "stop", "invalid_value", "stop: expected up to 16 non-empty strings"),
    ({"stop": ""}, "stop", "invalid_value", "non-empty"),
    ({"logprob": True}, "logprob", "unknown_parameter", "Unrecognized request argument supplied: logprob"),
    ({"metadata": {"Key": 1}}, "metadata.Key", "invalid_value", "valid string"),  # a key, not a union member
    ({"logit_bias": {"one": 2}}, "logit_bias.one", "invalid_value", ""),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value", 'type "xml" is not supported'),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"},
     "tools[0].function.name", "invalid_value", "String should match pattern"),
])
def test_non_union_errors_name_their_field(extra, param, code, fragment):
    e = chat_error(**extra)
    assert (e.param, e.code) == (param, code), e.body()
    assert fragment in e.message


def test_content_parts_keep_their_paths():
    e = chat_error(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}])
    assert e.param == "messages[0].content[0].image_url.url", e.body()
    e = chat_error(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}])
    assert (e.param, e.code) == ("messages[0].content[0].extra", "unknown_parameter"), e.body()


# ------------------------------------------------------------ the general rules
class _Named(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["named"]
    name: str


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    plain: int | list[int] | None = None
    choice: Literal["a", "b"] | _Named | None = None
    worded: Annotated[str | list[str] | None, accepts("text or lines of text")] = None
    nested: list[str | _Named] | None = None


def model_error(**body: Any) -> ApiError:
    with pytest.raises(ValidationError) as e:
        _Model.model_validate_json(json.dumps(body))
    return from_validation_error(e.value, PART_TAGS)


@pytest.mark.parametrize("body,param,message", [
    ({"plain": "x"}, "plain", 'plain: expected an integer or a list of integers (got "x")'),
    ({"plain": [1, "x"]}, "plain[1]", "plain[1]: Input should be a valid integer"),
    ({"choice": 1}, "choice", 'choice: expected "a", "b" or an object (got 1)'),
    ({"choice": {"type": "other"}}, "choice", 'choice: expected "a", "b" or an object of type "named" '
     '(got an object of type "other")'),
    ({"choice": {"type": "named", "name": 1}}, "choice.name", "choice.name: Input should be a valid string"),
    ({"worded": 1}, "worded", "worded: expected text or lines of text (got 1)"),
    ({"worded": [1]}, "worded[0]", "worded[0]: Input should be a valid string"),
    ({"nested": ["a", 2]}, "nested[1]", "nested[1]: expected a string or an object (got 2)"),
    ({"nested": [{"type": "named", "name": "n", "x": 1}]}, "nested[0].x", "Unrecognized request argument"),
])
def test_union_members_never_reach_param(body, param, message):
    e = model_error(**body)
    assert e.param == param, e.body()
    assert message in e.message, e.body()


def test_loc_to_param_drops_member_names():
    assert loc_to_param(("stop", "str")) == "stop"
    assert loc_to_param(("prompt", "list[int]", 1)) == "prompt[1]"
    assert loc_to_param(("tool_choice", "NamedToolChoice", "function", "name")) == "tool_choice.function.name"
    assert loc_to_param(("x", "function-after[_check(), str]")) == "x"
    assert loc_to_param(("messages", 0, "content", 1, "image_url", "image_url", "url"), PART_TAGS) == \
        "messages[0].content[1].image_url.url"


# ------------------------------------------------------------ empty content, values shown cut
@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": []}], "messages[1].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [],
                                          "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[1].content"),
])
def test_an_empty_content_array_is_refused_naming_it(messages, param):
    """As OpenAI answers it (400, empty_array): an empty list of parts is no message, not an empty one."""
    e = chat_error(messages=messages)
    assert (e.param, e.code) == (param, "empty_array"), e.body()
    assert e.message == f"{param}: empty array: expected text or at least one content part"


@pytest.mark.parametrize("value,text", [
    ("a" * 4097, '"' + "a" * 57 + '…"'),
    ("x" * 56 + '"quoted"', '"' + "x" * 56 + '…"'),  # the cut falls in the escape \": no half of it is shown
    ("é" * 40, '"' + r"\u00e9" * 9 + '…"'),
    ([1, 2, "b" * 80], '[1, 2, "' + "b" * 50 + '…"'),
    ("short", '"short"'),
    (7, "7"),
], ids=["long", "escape_at_the_cut", "non_ascii", "in_a_list", "short", "number"])
def test_a_value_shown_cut_keeps_its_quotes(value, text):
    """Every message that echoes a value cuts it with pydantic_errors.shown: the cut is marked and a string the cut
    falls in still closes (a plain slice printed `(got 'aaaa…aaa)`, its closing quote gone)."""
    from omni.config.pydantic_errors import shown

    assert shown(value) == text and len(text) <= 60


@pytest.mark.parametrize("extra,param", [
    ({"messages": [{"role": "r" * 100, "content": "x"}]}, "messages[0].role"),  # pydantic's own error
    ({"reasoning_effort": "r" * 100}, "reasoning_effort"),  # a field this server does not implement
])
def test_a_long_value_in_a_400_is_shown_cut_with_its_quotes(extra, param):
    e = chat_error(**extra)
    assert e.param == param, e.body()
    assert e.message.endswith('(got "' + "r" * 57 + '…")'), e.body()
