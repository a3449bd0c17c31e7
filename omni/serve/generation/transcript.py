"""A speech recognizer's reply as a transcript. Qwen3-ASR writes "language English<asr_text>The text." (the
language it heard, then the marker, then the transcript; with the language forced, the prompt ends with the tag and
the reply is the transcript alone). The endpoints show the transcript, and the language where OpenAI's shapes have
one, read as `Qwen3ASRProcessor.parse_output` reads them: the text after the marker, stripped; the first line
before it, less "language ", as the language ("None": none heard); no marker at all: the whole reply, stripped.

As the reply streams (`feed` each piece, `finish` at its end), the tag is held back until the marker ends it, and
whitespace at either end of the transcript never goes out. A reply of a model with no marker (an omni thinker
asked to transcribe) passes through as it is.
"""
from __future__ import annotations


def _language(tag: str) -> str | None:
    line = next((x.strip() for x in tag.strip().splitlines() if x.strip()), "")
    name = line[len("language "):].strip() if line.lower().startswith("language ") else line
    return None if not name or name.lower() == "none" else name


class Transcript:
    def __init__(self, marker: str | None):
        self.marker = marker
        self.language: str | None = None  # the language the tag names, once the marker has come
        self.text = ""  # the transcript sent so far
        self._head = ""  # the reply while no marker has come: the tag so far (or, at the end, the transcript)
        self._found = marker is None
        self._lead = marker is not None  # the transcript's leading whitespace is still to be dropped
        self._held = ""  # trailing whitespace: sent once more text follows it

    def feed(self, piece: str) -> str:
        """The transcript's text this piece of the reply completes ("" while the tag is not over)."""
        if not self._found:
            self._head += piece
            at = self._head.find(self.marker)
            if at < 0:
                return ""
            tag, piece, self._head = self._head[:at], self._head[at + len(self.marker):], ""
            self.language, self._found = _language(tag), True
        return self._emit(piece)

    def finish(self) -> str:
        """What is left at the reply's end: a reply with no marker is all transcript."""
        if self._found:
            return ""
        self._found = True
        head, self._head = self._head, ""
        return self._emit(head)

    def _emit(self, piece: str) -> str:
        if self.marker is None:
            self.text += piece
            return piece
        if self._lead:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._lead = False
        body = self._held + piece
        out = body.rstrip()
        self._held = body[len(out):]
        self.text += out
        return out
