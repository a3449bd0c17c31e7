"""The Qwen3-ASR -> chat LLM edge of a voice agent: the transcript (its language tag dropped) replaces the last user
turn's audio in the conversation the LLM continues; audio in an earlier turn is refused by name."""
from __future__ import annotations

import pytest

from omni.errors import RequestError
from omni.messages import StageInput, StageOutput
from stages.qwen3_asr.edges import asr2chat, transcript, with_transcript


def _asr(text: str) -> dict[str, StageOutput]:
    return {"asr": StageOutput("r", "asr", text=text)}


@pytest.mark.parametrize("reply, want", [("language English<asr_text> Hello there. ", "Hello there."),
                                         ("no marker at all", "no marker at all"), ("language None<asr_text>", "")])
def test_transcript_is_the_text_after_the_marker(reply, want):
    assert transcript(reply) == want


def test_the_last_user_turns_audio_becomes_its_transcript():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
              {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": [{"type": "audio"}]}]
    inp = asr2chat(_asr("language English<asr_text>What time is it?"),
                   StageInput("r", prompt=prompt, extra={"speaker": "x"}, cache_salt="s"))
    assert inp.prompt == prompt[:3] + [{"role": "user", "content": "What time is it?"}]
    assert prompt[-1]["content"] == [{"type": "audio"}]  # the request's own conversation is not changed
    assert inp.extra == {"speaker": "x"} and inp.cache_salt == "s" and not inp.mm_inputs


def test_text_beside_the_audio_is_kept_and_a_text_prompt_becomes_one_turn():
    msgs = with_transcript([{"role": "user", "content": [{"type": "text", "text": "Listen:"}, {"type": "audio"}]}],
                           "words")
    assert msgs == [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, {"type": "text", "text": "words"}]}]
    assert with_transcript(None, "words") == [{"role": "user", "content": "words"}]
    assert with_transcript([{"role": "system", "content": "s"}], "w")[-1] == {"role": "user", "content": "w"}


def test_audio_in_an_earlier_turn_is_refused_by_name():
    prompt = [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "Yes."},
              {"role": "user", "content": [{"type": "audio"}]}]
    with pytest.raises(RequestError, match=r"prompt\[0\]\.content") as e:
        asr2chat(_asr("x"), StageInput("r", prompt=prompt))
    assert e.value.field == "prompt[0].content"


def test_a_typed_last_turn_is_the_conversation_as_it_is():
    prompt = [{"role": "user", "content": "What is the time?"}]
    assert with_transcript(prompt, "") == prompt
    assert with_transcript("Hello?", "") == [{"role": "user", "content": "Hello?"}]
