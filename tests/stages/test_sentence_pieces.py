"""The sentence cutter a voice agent's LLM -> TTS edge speaks by: pieces as soon as complete, never inside an
abbreviation or a number, bounded in length, and the pieces joined are the stream (nothing lost or twice), however
the stream is split into deltas."""
from __future__ import annotations

import random

import pytest

from stages.common.sentence_pieces import SentenceCutter


def cut(text: str, deltas: list[int] | None = None, **kw) -> list[str]:
    """The pieces of `text` fed in deltas of the given sizes (default: one character at a time), then flushed."""
    c = SentenceCutter(**kw)
    out, i = [], 0
    for n in deltas or [1] * len(text):
        out += c.feed(text[i:i + n])
        i += n
    out += c.feed(text[i:])
    rest = c.flush()
    return out + ([rest] if rest else [])


def test_sentences_are_cut_at_their_ends_with_their_closing_quotes():
    text = 'Hello there! How are you? He said "fine." Then we left.'
    assert cut(text) == ["Hello there!", " How are you?", ' He said "fine."', " Then we left."]


@pytest.mark.parametrize("text", [
    "Mr. Smith met Dr. Jones at 3.14 p.m. today.",
    "The U.S. team won, e.g. at No. 5 in the list.",
    "J. R. R. Tolkien wrote it.",
    "Prices rose 2.5 percent in 2024.",
])
def test_abbreviations_initials_and_numbers_do_not_end_a_sentence(text):
    assert cut(text) == [text]


def test_a_year_or_an_ellipsis_before_the_end_still_ends_it():
    assert cut("It was 2024. Then came more... And more.") == ["It was 2024.", " Then came more...", " And more."]


def test_an_end_is_known_once_the_next_character_arrives():
    c = SentenceCutter()
    assert c.feed("Done.") == []  # "Done.5" would be a number
    assert c.feed(" Next") == ["Done."]
    assert c.flush() == " Next"
    assert c.flush() is None


def test_long_sentences_cut_at_clauses_and_runs_without_punctuation_at_words():
    clause = "This sentence runs on for quite a while before it reaches a comma, and then it keeps going."
    assert cut(clause, clause_chars=40) == ["This sentence runs on for quite a while before it reaches a comma,",
                                           " and then it keeps going."]
    assert cut("short, clause.", clause_chars=40) == ["short, clause."]  # a short clause is not cut
    words = " ".join(["word"] * 60)
    pieces = cut(words, clause_chars=50, max_chars=50)
    assert all(len(p) <= 50 for p in pieces) and len(pieces) > 5 and "".join(pieces) == words
    assert all(p.startswith(" ") for p in pieces[1:])  # cut at word boundaries
    # no space at all: at max_chars
    assert cut("x" * 120, clause_chars=50, max_chars=50) == ["x" * 50, "x" * 50, "x" * 20]


def test_pieces_joined_are_the_stream_whatever_the_deltas():
    rng = random.Random(0)
    text = ("Well, I think so. Dr. Who said: “maybe!” The cost was $3.50, or 4.2 euros… Really? "
            "Yes; " + "no punctuation here at all " * 12 + "end.")
    for trial in range(30):
        sizes = [rng.randint(1, 9) for _ in range(len(text))]
        pieces = cut(text, sizes, clause_chars=30, max_chars=80)
        assert "".join(pieces) == text, trial
        assert all(0 < len(p) <= 80 for p in pieces)
    assert cut(text, [len(text)], clause_chars=30, max_chars=80) == cut(text, clause_chars=30, max_chars=80)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="clause_chars <= max_chars"):
        SentenceCutter(clause_chars=300, max_chars=200)
