"""The Hermes tool-call parser of tool_choice "auto" (omni/serve/generation/tool_parser.py), whole replies and
streamed ones: however a reply is cut into deltas, the stream ends with exactly what the whole reply parses to."""
from __future__ import annotations

import json
import random

import pytest

from omni.serve.generation.tool_parser import ToolCallStream, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {"zone": "utc"}}'


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_and_the_content_before_them():
    content, calls = parse_tool_calls(f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n"
                                      "</tool_call>\nDone.")
    assert content == "Let me check.\n"
    assert _calls(calls) == [("get_weather", {"unit": "c", "days": 2}), ("get_time", {"zone": "utc"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls(f"<tool_call>{WEATHER}</tool_call>")[0] is None  # nothing before: no content
    assert parse_tool_calls(f"  \n<tool_call>{WEATHER}</tool_call>")[0] is None


def test_a_last_call_without_its_closing_tag_and_arguments_given_as_text():
    _, calls = parse_tool_calls(f"<tool_call>\n{TIME}\n")  # the reply ended before </tool_call>
    assert _calls(calls) == [("get_time", {"zone": "utc"})]
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')  # no arguments: an empty object
    assert calls[0]["function"]["arguments"] == "{}"
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # not \\u-escaped


@pytest.mark.parametrize("text", [
    "Just text, no call.",
    f"<tool_call>\n{WEATHER[:-5]}\n</tool_call>",  # not JSON
    "<tool_call>[1, 2]</tool_call>",  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>",  # one bad block: the whole reply is text
    "a < b and <tool_ca",
])
def test_what_is_not_calls_is_the_whole_text(text):
    assert parse_tool_calls(text) == (text, None)


REPLIES = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>\n{TIME}",
    "Plain text with a < sign and <tool and <tool_cal but no call.",
    "ends with the start of a tag <tool_cal",
    f"<tool_call>{WEATHER[:-5]}</tool_call> trailing",
    "<<tool_call>" + WEATHER + "</tool_call>",
    "",
]


@pytest.mark.parametrize("reply", REPLIES)
def test_a_stream_ends_with_what_the_whole_reply_parses_to(reply):
    content, calls = parse_tool_calls(reply)
    rng = random.Random(len(reply))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 12))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        stream = ToolCallStream()
        sent = "".join(stream.feed(p) for p in pieces)
        rest, got = stream.finish()
        if calls is None:
            assert got is None and sent + rest == reply
        else:
            assert _calls(got) == _calls(calls) and rest == "" and sent == reply[: reply.find("<tool_call>")]
            assert (content or "") == sent


def test_content_before_a_call_is_sent_as_it_comes():
    stream = ToolCallStream()
    assert stream.feed("Checking the ") == "Checking the "
    assert stream.feed("weather <") == "weather "  # "<" may begin the tag: held
    assert stream.feed("b>") == "<b>"
    assert stream.feed("\n<tool") == "\n"
    assert stream.feed("_call>{") == ""  # from the tag on, held to the end
    assert stream.feed(WEATHER[1:] + "</tool_call>") == ""
    rest, calls = stream.finish()
    assert rest == "" and _calls(calls) == [("get_weather", {"unit": "c", "days": 2})]
