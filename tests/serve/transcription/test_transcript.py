"""A speech recognizer's reply as a transcript (omni/serve/generation/transcript.py) reads as Qwen3ASRProcessor's
parse_output reads it, however the reply is cut into streamed pieces; a thinker's reply passes through."""
from __future__ import annotations

import pytest

from omni.serve.generation.transcript import Transcript

MARKER = "<asr_text>"
REPLIES = ["language English<asr_text> Hello there, Godot.  ", "language None<asr_text>", "no tag at all \n",
           "language Chinese\n<asr_text>你好，世界", "  language German<asr_text>Guten Tag\n",
           "German<asr_text>ja", "language English<asr_text>a<asr_text>b", "", "language Eng"]


def _streamed(reply: str, cuts: list[int]) -> tuple[list[str], Transcript]:
    t = Transcript(MARKER)
    bounds = [0, *cuts, len(reply)]
    pieces = [t.feed(reply[a:b]) for a, b in zip(bounds, bounds[1:])] + [t.finish()]
    return pieces, t


@pytest.mark.parametrize("reply", REPLIES)
def test_every_cut_of_the_reply_reads_as_the_processor_parses_it(reply):
    from transformers.models.qwen3_asr.processing_qwen3_asr import _parse_single_output

    want = _parse_single_output(reply)
    for cuts in [[]] + [[i] for i in range(1, len(reply))] + [list(range(1, len(reply)))]:
        pieces, t = _streamed(reply, cuts)
        assert "".join(pieces) == t.text == want["transcription"], cuts
        assert t.language == want["language"], cuts


def test_the_tag_is_held_back_until_the_marker_and_trailing_space_until_more_text():
    t = Transcript(MARKER)
    assert t.feed("language Eng") == "" and t.feed("lish<asr") == ""
    assert t.feed("_text> Hello ") == "Hello" and t.language == "English"
    assert t.feed(" world  ") == "  world" and t.finish() == "" and t.text == "Hello  world"


def test_a_reply_without_a_marker_to_look_for_passes_through_as_it_is():
    t = Transcript(None)
    assert [t.feed(" Hello"), t.feed(" <asr_text> "), t.finish()] == [" Hello", " <asr_text> ", ""]
    assert t.text == " Hello <asr_text> " and t.language is None
